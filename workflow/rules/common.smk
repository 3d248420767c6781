# Shared definitions: artifact paths, wildcards, the model x bits x rotation x persist fan-out,
# the vqpipe source files each stage depends on, BLAS and per-model options.

import ast
import functools
import importlib
import importlib.metadata
import json
import os
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

# The repository holding this workflow/ (a temporary copy of the repository uses its own vqpipe).
ROOT = Path(workflow.basedir).parent
sys.path.insert(0, str(ROOT))
from vqpipe import blas as vqblas  # noqa: E402  (does not import mlx)
from vqpipe.store import snakecache  # noqa: E402
from vqpipe.report import plots as vqplots, render as vqrender  # noqa: E402  (no mlx: matplotlib, jinja2 only)

# Race-safe, read-only-tolerant storing into the between-workflow cache (vqpipe/store/snakecache.py).
snakecache.install()

# The interpreter running Snakemake (the project's .venv) runs every stage: its bin/ goes first on
# the PATH the jobs inherit (with --use-conda, the rule's environment goes before it).
envvars:
    "PATH",


vqblas.prepend_path(Path(sys.executable).parent)


# --- artifact paths (docs/architecture.md) -----------------------------------------------------

# {variant} of docs/architecture.md is b{bits}-{rotation} here: two wildcards, both params.
SOURCE = "results/models/{model}/source"
QUANTIZED = "results/quantized/{model}/b{bits}-{rotation}"
MOMENTS = "results/calibration/{model}"
RESERVOIR = "results/reservoir/{model}/b{bits}-{rotation}/persist-{persist}"
VERDICT = "results/validate/{model}/b{bits}-{rotation}/persist-{persist}.json"
BENCH_QUALITY = "results/bench/{model}/quality.json"
BENCH_QUALITY_REFERENCE = "results/bench/{model}/quality-reference"
BENCH_QUALITY_PART = "results/bench/{model}/quality.b{bits}-{arm}.json"
BENCH_LOAD = "results/bench/{model}/load.json"
BENCH_DECODE = "results/bench/{model}/decode.json"
BENCH_KIVI = "results/bench/kivi.json"
BENCH_KV_QUALITY = "results/bench/{model}/kv_quality.json"
# The report's plots and tables (one page each in Snakemake's report), as vqpipe names them.
REPORT_PLOTS = list(vqplots.PLOTS)
REPORT_TABLES = list(vqrender.TABLES)
REPORT_TEMPLATES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "vqpipe" / "report" / "templates").glob("*.j2"))


wildcard_constraints:
    model=r"[A-Za-z0-9][A-Za-z0-9._-]*",
    bits=r"\d+",
    rotation="auto|hadamard|kron|qr|none",
    persist="on|off",
    arm=r"vqpipe|unrotated|affine-g\d+|mlx-gptq|mlx-awq|mlx-dynamic|mlx-dwq|mxfp4|nvfp4",


MODELS = list(config["models"])
BITS = list(config["bits"])
ROTATIONS = list(config["rotations"])
PERSIST = ["on" if p else "off" for p in config["persist_rotation"]]
# bench-quality's vqpipe arm: this rotation's quantize artifact (its unrotated arm: rotation none).
QUALITY_ROTATION = config["benchmarks"]["quality"].get("rotation") or next(
    (r for r in ROTATIONS if r != "none"), "auto")
# bench-quality's arms, one job each per bit width (records in this order).
QUALITY_ARMS = ["vqpipe", "unrotated"] + [f"affine-g{g}" for g in config["benchmarks"]["quality"]["affine_groups"]] + \
    list(config["benchmarks"]["quality"]["competitors"])
# Widths MLX's fp4 modes store (4-bit floats only). Their other widths are not scheduled: a job
# would only print the refusal. The merge asks the tool (vqpipe.competitors.check) for each arm
# it gets no part of and records the refusal in the tool's words, so the report still lists it;
# an arm neither measured nor refused fails the merge.
FP4_WIDTHS = {"mxfp4": [4], "nvfp4": [4]}


# Widths of vqpipe's unrotated ablation (the rotation-none quantize artifact: what the rotation
# buys). Each width costs a quantize job and an arm job of the model (~85 CPU-s for SmolLM2).
UNROTATED_BITS = [b for b in BITS if b in config["benchmarks"]["quality"]["unrotated_bits"]]


def _asked(bits, arm):
    return arm != "unrotated" or bits in UNROTATED_BITS


def quality_expected():
    """Every (bits, arm) bench-quality asks for, in record order (BITS:ARM, the merge's --expect)."""
    return [f"{b}:{a}" for b in BITS for a in QUALITY_ARMS if _asked(b, a)]


def quality_parts(wc):
    """The arm jobs a model's bench-quality merges: every arm asked for but the refused fp4 widths."""
    return [BENCH_QUALITY_PART.format(model=wc.model, bits=b, arm=a)
            for b in BITS for a in QUALITY_ARMS if _asked(b, a) and b in FP4_WIDTHS.get(a, [b])]


def fan_out(pattern):
    """``pattern`` expanded over every model x bits x rotation (x persist when it has {persist})."""
    return expand(pattern, model=MODELS, bits=BITS, rotation=ROTATIONS, persist=PERSIST)


def bench_models(bench):
    """The models benchmark ``bench`` measures: its `models` key, or every model."""
    names = config["benchmarks"][bench].get("models", MODELS)
    for name in names:
        if name not in config["models"]:
            raise WorkflowError(f"config key 'benchmarks.{bench}.models': {name!r} is not a key of 'models'")
    return names


def bench_outputs():
    """Every benchmark JSON the config asks for."""
    out = []
    if config["benchmarks"]["quality"]["enabled"]:
        out += expand(BENCH_QUALITY, model=bench_models("quality"))
    if config["benchmarks"]["load"]["enabled"]:
        out += expand(BENCH_LOAD, model=bench_models("load"))
    if config["benchmarks"]["decode"]["enabled"]:
        out += expand(BENCH_DECODE, model=bench_models("decode"))
    if config["benchmarks"]["kivi"]["enabled"]:
        out.append(BENCH_KIVI)
    if config["benchmarks"]["kv_quality"]["enabled"]:
        out += expand(BENCH_KV_QUALITY, model=kv_quality_models())
    return out


def kv_quality_models():
    """The models bench-kv-quality measures: its `models` key, else bench-decode's."""
    c = config["benchmarks"]["kv_quality"]
    return bench_models("kv_quality") if "models" in c else bench_models("decode")


def quality_artifact(wc):
    """The quantize artifact a bench-quality arm measures: its rotation's, or none (affine); mlx-dynamic
    reads the vqpipe artifact's bits per weight as its budget."""
    rotation = {"vqpipe": QUALITY_ROTATION, "mlx-dynamic": QUALITY_ROTATION, "unrotated": "none"}.get(wc.arm)
    return [QUANTIZED.format(model=wc.model, bits=wc.bits, rotation=rotation)] if rotation else []


def decode_artifact(pattern):
    """``pattern`` (RESERVOIR or VERDICT) for the reservoir bench-decode measures, {model} left open."""
    c = config["benchmarks"]["decode"]
    return expand(
        pattern,
        model="{model}",
        bits=c["bits"],
        rotation=c["rotation"],
        persist="on" if c["persist_rotation"] else "off",
    )[0]


def decode_options():
    """bench-decode flags for the options the config sets (the others keep the stage's defaults)."""
    c = config["benchmarks"]["decode"]
    flags = ["--quick"] if c["quick"] else []
    for key in ("prompt_lengths", "gen_tokens", "repeats", "load_repeats", "weights", "caches", "dtype"):
        if key in c:
            values = c[key] if isinstance(c[key], list) else [c[key]]
            flags.append(f"--{key.replace('_', '-')} " + " ".join(map(str, values)))
    return " ".join(flags)


def all_targets():
    """The default target: the report (it depends on every verdict and benchmark)."""
    return rules.report.output


# --- BLAS --------------------------------------------------------------------------------------
# Float sums depend on the BLAS, so the resolved setup ('openblas', 'reference' or 'accelerate' on
# macOS) is a param of every rule whose output holds computed floats, and quantize and validate
# run under the same one (validate refuses to compare across setups).

try:
    BLAS = vqblas.choice({"VQPIPE_BLAS": config["blas"]})
except (ValueError, RuntimeError) as e:
    raise WorkflowError(f"config key 'blas': {e}")

# The one place the BLAS of a job is decided: the environment every job starts in (vqpipe/blas.py).
vqblas.apply(BLAS)

# Software whose version changes artifacts: a param of the cached rules, so the between-workflow
# cache (which omits the software environment) rebuilds when mlx, mlx-lm or vqpipe changes.
SOFTWARE = {d: importlib.metadata.version(d) for d in ("mlx", "mlx-lm", "numpy")}
SOFTWARE["vqpipe"] = importlib.import_module("vqpipe").__version__

# The rules' software environment (the pinned dependencies of pyproject.toml): used with --use-conda.
ENV = "../envs/vqpipe.yaml"


def vqpipe_cmd(args):
    """The shell command of a stage: ``python -m vqpipe ARGS``, logged.

    Only job-local values are filled in ({threads}, {log}): the command template (part of the
    between-workflow cache key) is the same on every machine. OPENBLAS_NUM_THREADS follows the
    rule's threads (every artifact records it in its setup); PYTHONUNBUFFERED makes progress lines
    reach the log as they happen.
    """
    return f"OPENBLAS_NUM_THREADS={{threads}} PYTHONUNBUFFERED=1 python -m vqpipe {args} > {{log:q}} 2>&1"


# --- scheduling ---------------------------------------------------------------------------------
# On a few cores a run takes as long as its longest chain: a calibrated model's download ->
# calibrate -> quantize -> bench-quality's vqpipe and unrotated arms (docs/run-time.md measures
# it). Its jobs go first; then the long jobs that need only a source (bench-quality's reference
# and affine arms, bench-load) and bench-decode with the few jobs making its reservoir, which
# fill the other cores while the chain runs; everything else (short jobs: the synthetic models'
# matrix, packing, validation) last, filling the cores at the end. Snakemake runs the ready job
# of highest priority first.
PRIORITY = {"chain": 100, "source_only": 50, "rest": 0}


def calibrated(model):
    """Whether ``model``'s quantize jobs read calibration text (the long chain)."""
    return quantize_option(model, "calibration")["text"] != "none"


def feeds_decode(w):
    """Whether a download/quantize/pack/validate job makes (part of) the reservoir bench-decode measures."""
    c = config["benchmarks"]["decode"]
    if not c["enabled"] or w.model not in bench_models("decode"):
        return False
    if "rotation" in w.keys() and (int(w.bits), w.rotation) != (c["bits"], c["rotation"]):
        return False
    return w.get("persist", None) in (None, "on" if c["persist_rotation"] else "off")


def priority(step=None):
    """The priority function of a rule whose jobs are ``step`` along a calibrated model's chain
    (0 first; None: never on it)."""

    def of(w):
        if step is not None and calibrated(w.model):
            return PRIORITY["chain"] - step
        return PRIORITY["source_only"] if feeds_decode(w) else PRIORITY["rest"]

    return of


def quality_calib_flags(w):
    """The mlx-lm arms' calibration: the calibrate stage's tokens for this model (windows, length,
    seed), fewer where benchmarks.quality says (their cost on a CPU)."""
    q, calib = config["benchmarks"]["quality"], {**config["quantize"]["calibration"], **quantize_option(w.model, "calibration")}
    flags = [f"--calib-windows {q['calib_windows'] or calib['windows']}", f"--calib-length {calib['length']}",
             f"--calib-seed {calib['seed']}"]
    flags += [f"--{k.replace('_', '-')} {q[k]}" for k in ("gptq_windows", "awq_windows", "dynamic_windows", "dwq_windows")
              if q.get(k)]
    return " ".join(flags)


def quality_arm_priority(w):
    """bench-quality's vqpipe and unrotated arms are the end of a calibrated model's chain; its
    affine arms need only the source."""
    if w.arm not in ("vqpipe", "unrotated", "mlx-dynamic"):
        return PRIORITY["source_only"]
    return PRIORITY["chain"] - 2 if calibrated(w.model) else PRIORITY["rest"]


# --- per-model options --------------------------------------------------------------------------
# (Per-rule resources live in workflow/profiles/default, the one place for them.)


def source_files(wc):
    """A gguf: source's file, as an input: a changed file reruns download (and keys its cache)."""
    source = config["models"][wc.model]["source"]
    if not source.startswith("gguf:"):
        return []
    from vqpipe.sources.gguf import resolve  # no mlx import

    try:
        return [str(resolve(source[len("gguf:"):]))]
    except (FileNotFoundError, ValueError) as e:
        raise WorkflowError(f"config key 'models.{wc.model}.source': {e}")


def quantize_option(model, key):
    """Quantize option ``key`` of ``model``: models.NAME.quantize.KEY, else quantize.KEY; calibration
    text auto resolved (text for every model but a synth: one: random weights have no text to fit)."""
    value = config["models"][model].get("quantize", {}).get(key, config["quantize"][key])
    if key == "calibration" and value["text"] == "auto":
        value = {**value, "text": "none" if config["models"][model]["source"].startswith("synth:") else "text"}
    return value


def budget_flag(model, bits):
    """--budget of ``model``'s quantize job at ``bits``."""
    budget = quantize_option(model, "budget")
    if isinstance(budget, dict):
        widths = {str(k): v for k, v in budget.items()}
        if str(bits) not in widths:
            raise WorkflowError(f"config: budget of {model} names no bits per weight for width {bits}")
        budget = widths[str(bits)]
    return f" --budget {budget}"


def quantize_flags(model, rotation, bits):
    """Command-line flags of the options that change the codes (all of them are rule params)."""
    q = config["quantize"]
    emb = quantize_option(model, "embeddings")
    flags = (" --embeddings" if emb else " --no-embeddings") + ("" if q["lm_head"] else " --no-lm-head")
    group = quantize_option(model, "group_size")
    if group is not None:
        flags += f" --group-size {group}"
    rules = quantize_option(model, "layer_bits")
    if rules:
        flags += f" --layer-bits {shlex.quote(json.dumps(rules, separators=(',', ':')))}"
    if rotation != "none":  # bench-quality's unrotated arm: no rotation at all, none of the stream either
        flags += residual_flags(model)
    cal = quantize_option(model, "calibration")
    if stored_moments(model):
        flags += f" --moments {MOMENTS.format(model=model)} --damp {cal['damp']}"
    elif cal["text"] != "none":
        flags += (f" --calibration {cal['text']} --calib-windows {cal['windows']} --calib-length {cal['length']}"
                  f" --calib-seed {cal['seed']} --damp {cal['damp']}" + (" --sequential" if cal["sequential"] else ""))
    else:
        flags += " --calibration none"
    if cal["text"] != "none":  # data-free quantization has no windows to tune on
        flags += "".join(f" --tune-{k} {v}" for k, v in sorted(quantize_option(model, "tune").items()))
    return flags + budget_flag(model, bits)


def residual_flags(model):
    """The residual rotation's flag for ``model``'s quantize jobs of the pipeline's rotation ('' when off)."""
    if not quantize_option(model, "residual_rotation"):
        return ""
    if len(ROTATIONS) != 1 or ROTATIONS[0] not in ("auto", "hadamard", "kron"):
        raise WorkflowError(f"config: models.{model} quantizes with residual_rotation, which needs rotations to "
                            f"be one of [auto], [hadamard], [kron] (its moments and codes are made in that "
                            f"rotation's stream basis), not {ROTATIONS}")
    return " --residual-rotation"


def calibrate_flags(model):
    """The calibrate job's residual flags: the rotated model's moments, and the plain model's too
    where bench-quality's unrotated arm quantizes this model without any rotation."""
    if not residual_flags(model):
        return ""
    plain = config["benchmarks"]["quality"]["enabled"] and model in bench_models("quality")
    return f" --residual-rotation {ROTATIONS[0]} --seed {config['quantize']['seed']}" + (" --plain" if plain else "")


def stored_moments(model):
    """Whether ``model``'s quantize jobs read the calibrate stage's full-precision moments (one
    pass per model for every bit width and rotation) instead of calibrating sequentially."""
    cal = quantize_option(model, "calibration")
    return cal["text"] != "none" and not cal.get("sequential", True)


# --- the vqpipe source files of a stage ----------------------------------------------------------
# A stage's inputs list the files of its modules and of every vqpipe module they import at module
# level, transitively; editing one reruns that stage and what follows, and nothing upstream.
# Imports inside functions are not followed (they often reach other stages' CLIs); the rules name
# such dependencies explicitly.


def _module_file(name):
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.cache  # each stage_sources call walks a closure: parse every file once, not once per rule
def _module_imports(path, name):
    """Dotted names a module imports at module level (vqpipe.* only)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1])
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module
                found.append(target)
                # `from . import x` may import the submodule x
                found.extend(f"{target}.{alias.name}" for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text(), str(path)).body)
    return tuple(m for m in found if m == "vqpipe" or m.startswith("vqpipe."))


@functools.cache
def _closure(modules):
    seen, todo = set(), list(modules)
    while todo:
        name = todo.pop()
        if name in seen or _module_file(name) is None:
            continue
        seen.add(name)
        todo.extend(_module_imports(_module_file(name), name))
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parent packages run too
    files = {str(_module_file(m).relative_to(ROOT)) for m in seen}
    # A stage module that does not exist yet still shows up, as a missing input.
    files.update(f"{m.replace('.', '/')}.py" for m in modules if _module_file(m) is None)
    return sorted(files)


def stage_sources(*modules, data=()):
    """The source files (repository-relative) behind ``modules``, plus package data files ``data``.

    Marked local(): with a default storage provider they are still read from the checkout.
    """
    return [local(f) for f in _closure(tuple(modules)) + [f"vqpipe/data/{d}" for d in data]]
