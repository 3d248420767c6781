"""The workflow config's checks that the schema cannot make, as one readable line each.

The Snakefile runs them before it builds the DAG, so ``snakemake -n`` fails on a config whose job
would fail later: an unknown synthetic preset, a ``path:`` directory or GGUF file that is not
there, a source with an unknown scheme. No MLX import (the Snakefile imports this).
"""

from pathlib import Path


def schema_error(error):
    """A jsonschema ``ValidationError`` as one line: the config key, the value and what is allowed."""
    where = f"config key '{'.'.join(str(p) for p in error.absolute_path)}'" if error.absolute_path else "config"
    want = error.schema.get("description") if isinstance(error.schema, dict) else None
    if error.validator == "pattern" and want:  # the regular expression itself says little
        return f"{where}: {error.instance!r} is not allowed here; expected {' '.join(want.split())}"
    return f"{where}: {' '.join(error.message.split())}"


def source_problem(source):
    """Why a model ``source`` cannot be fetched from this machine (one sentence), or None.

    hf: sources are not checked here: whether a repository exists is the network's answer.
    """
    from .sources.spec import check_model_dir, parse_source

    try:
        scheme, value = parse_source(source)
    except ValueError as e:
        return str(e)
    try:
        if scheme == "synth":
            from .sources.synth import parse_preset

            parse_preset(value)
        elif scheme == "path":
            check_model_dir(Path(value).expanduser())
        elif scheme == "gguf":
            from .sources.gguf import resolve

            resolve(value)
    except (ValueError, FileNotFoundError) as e:
        return str(e)
    return None


def model_problems(models):
    """One line per model of a config's ``models`` whose source cannot be fetched."""
    return [f"config key 'models.{name}.source': {why}" for name, m in models.items()
            if (why := source_problem(m["source"]))]
