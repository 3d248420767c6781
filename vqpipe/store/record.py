"""The artifact record: the one JSON shape every stage writes about what it made.

A record is one JSON object: the envelope (the keys below, the same for every stage) and the
stage's payload (its own keys, at the top level beside the envelope, so readers of earlier
artifacts keep finding them). ``workflow/schemas/record.schema.json`` describes both; ``write``
checks a record against it before writing it atomically, and ``read`` (the report) checks what it
reads, so a malformed record is refused with the file and the field named.

Envelope:

- ``record``: the version of this shape (``FORMAT``)
- ``stage``: the stage that wrote it (``STAGES``); ``kind`` repeats it (the key earlier readers use)
- ``vqpipe_version``, ``software``: vqpipe's version and the installed python, mlx, mlx-lm, numpy
- ``model``, ``variant``: the model name and ``b{bits}-{rotation}``, or null where the stage spans
  several (bench-load measures several variants; bench-kivi is model independent)
- ``environment``: the setup the numbers were computed on (``vqpipe.bench.env.environment()``), or
  null for a stage that computes none (download, pack)
- ``inputs``: ``{name: path or [paths]}``, the artifacts the stage read

Nothing here imports MLX: the report reads records on a machine without it.
"""

import importlib.util
import json
import platform
from importlib import metadata
from pathlib import Path

from .. import __version__
from .fsutil import write_json

FORMAT = 1
STAGES = ("download", "calibrate", "quantize", "pack", "validate", "bench-load", "bench-decode", "bench-kivi", "bench-kv-quality", "bench-quality")
ENVELOPE = ("record", "stage", "kind", "vqpipe_version", "software", "model", "variant", "environment", "inputs")
SCHEMA = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "record.schema.json"


class RecordError(ValueError):
    """A file is not a valid record; the message names the file and the field."""


def software():
    """Installed versions of what changes a stage's numbers (read without importing MLX)."""
    out = {"python": platform.python_version()}
    for dist in ("mlx", "mlx-lm", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def model_name(source):
    """The model name of a download artifact ``results/models/{model}/source`` (else the dir's name)."""
    source = Path(source)
    return source.parent.name if source.name == "source" else source.name


def make(stage, payload, model=None, variant=None, environment=None, inputs=None):
    """The record of ``stage``: the envelope, then ``payload``'s keys.

    Envelope values not given are taken from the payload (``payload["model"]`` ...). A payload key
    that names an envelope field must agree with it: one value per field, never two.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")
    given = {"model": model, "variant": variant, "environment": environment}
    env = {"record": FORMAT, "stage": stage, "kind": stage, "vqpipe_version": __version__, "software": software(),
           **{k: v if v is not None else payload.get(k) for k, v in given.items()},
           "inputs": {k: [str(p) for p in v] if isinstance(v, (list, tuple)) else str(v)
                      for k, v in (inputs or {}).items() if v is not None}}
    clash = [k for k in ENVELOPE if k in payload and payload[k] != env[k] and k not in ("software", "inputs")]
    if clash:
        raise ValueError(f"{stage} record: payload key {clash[0]!r} = {payload[clash[0]]!r} differs from the "
                         f"envelope's {env[clash[0]]!r}")
    return {**env, **{k: v for k, v in payload.items() if k not in env}}


def write(path, stage, payload, **envelope):
    """Make the record of ``stage``, check it against the schema and write it to ``path`` atomically.

    The check needs jsonschema; a host without it (the offline GPU host) writes unchecked, and the
    report, which always checks, refuses what does not fit.
    """
    doc = make(stage, payload, **envelope)
    if importlib.util.find_spec("jsonschema") is not None:
        check(doc, path)
    write_json(path, doc)
    return doc


_VALIDATOR = None


def _validator():
    global _VALIDATOR
    if _VALIDATOR is None:
        try:
            import jsonschema
        except ImportError:
            raise RecordError("checking records needs jsonschema (pinned in pyproject.toml), which is not installed "
                              "here; copy the records to a machine with vqpipe's environment and report there") from None

        if not SCHEMA.is_file():
            raise RecordError(f"{SCHEMA}: the record schema is missing (vqpipe runs from its checkout)")
        schema = json.loads(SCHEMA.read_text())
        _VALIDATOR = jsonschema.Draft202012Validator(schema)
    return _VALIDATOR


def _field(error):
    return "/".join(map(str, error.absolute_path)) or "(top level)"


def check(doc, path="<record>"):
    """Raise RecordError naming ``path`` and the first offending field if ``doc`` is not a valid record."""
    if not isinstance(doc, dict) or "record" not in doc:
        raise RecordError(f"{path}: not a vqpipe record (no 'record' field)")
    errors = sorted(_validator().iter_errors(doc), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        import jsonschema

        e = jsonschema.exceptions.best_match(errors)
        raise RecordError(f"{path}: field {_field(e)!r}: {e.message}")


def read(path):
    """The record at ``path``, checked against the schema (RecordError otherwise)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise RecordError(f"{path}: cannot read a record ({e})") from None
    check(doc, path)
    return doc


def is_record(doc):
    return isinstance(doc, dict) and "record" in doc and "stage" in doc
