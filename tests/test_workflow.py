"""Integration tests: real Snakemake (a subprocess) on config/ci.yaml in temporary copies of the repo.

One tree is built once for the module (``tree``) and reused: what would rerun is read from dry
runs (the "Job stats" table), and real runs are used where the point is that running works
(first build, a second run doing nothing, an edited reservoir.py, a killed run resuming, a failing
validation). The between-workflow cache, the fs storage plugin and the SLURM profile each get
their own copies.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import yaml

from vqpipe.store import manifest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
IGNORE = shutil.ignore_patterns(
    ".git", ".venv", ".gpu", ".whl", "results", "logs", ".snakemake", "__pycache__", ".pytest_cache",
    "*.egg-info", "report.html", ".wt", ".dev-*",
)
CI = ["--configfile", "config/ci.yaml"]
MODEL, VARIANT = "tiny", "b4-auto"
SOURCE = f"results/models/{MODEL}/source"
QUANTIZED = f"results/quantized/{MODEL}/{VARIANT}"
RESERVOIR = f"results/reservoir/{MODEL}/{VARIANT}/persist-{{}}"
VERDICT = f"results/validate/{MODEL}/{VARIANT}/persist-{{}}.json"
REPORT = "results/report"
UPSTREAM = ("download", "quantize", "pack", "validate")


# --- helpers -------------------------------------------------------------------------------------


def copy_repo(dst, keep_mtimes=True, src=REPO):
    """A copy of the working tree without build state; ``keep_mtimes=False`` is like a fresh clone."""
    shutil.copytree(src, dst, ignore=IGNORE, copy_function=shutil.copy2 if keep_mtimes else shutil.copy)
    return Path(dst)


def smk(tree, *args, check=True, env=None, timeout=600):
    """Run snakemake in ``tree``; returns the CompletedProcess (stdout holds stderr too)."""
    cmd = SNAKEMAKE + ["--cores", "2", *args]
    proc = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc


def job_stats(output):
    """{rule: count} from the "Job stats" table of a snakemake run or dry run ({} when nothing to do)."""
    if "Nothing to be done" in output:
        return {}
    m = re.search(r"Job stats:\s*\njob\s+count\s*\n[-\s]+\n(.*?)\ntotal\s+\d+", output, re.S)
    assert m, f"no job stats in:\n{output[-3000:]}"
    return {rule: int(n) for rule, n in (line.split() for line in m.group(1).strip().splitlines())}


def plan(tree, *args, env=None):
    """What a run would execute: {rule: count}."""
    return job_stats(smk(tree, "-n", *args, env=env).stdout)


def downstream_rules(stats):
    """The rules of ``stats`` after validate (benchmarks, report, all)."""
    return {r for r in stats if r not in UPSTREAM}


def config_variant(tree, name, **changes):
    """config/ci.yaml with top-level keys replaced, written to config/NAME.yaml; returns the CLI args.

    (``--config key=[...]`` would not do: Snakemake parses list items as strings.)
    """
    config = yaml.safe_load((tree / "config/ci.yaml").read_text())
    config.update(changes)
    (tree / "config" / f"{name}.yaml").write_text(yaml.safe_dump(config))
    return ["--configfile", f"config/{name}.yaml"]


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def verdict(tree, persist):
    return json.loads((tree / VERDICT.format(persist)).read_text())


def mtimes(tree, paths):
    return {p: os.stat(tree / p).st_mtime_ns for p in paths}


def artifact_files(tree, rel):
    """Files of an output directory (resolving a cache symlink)."""
    return sorted(p for p in (tree / rel).resolve().iterdir() if not p.name.startswith("."))


def edit(path, text="\n# edited by tests/test_workflow.py\n"):
    """Append to a source file; returns a function restoring content and mtime."""
    path = Path(path)
    before, st = path.read_bytes(), path.stat()

    def restore():
        path.write_bytes(before)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    with open(path, "a") as f:
        f.write(text)
    return restore


# --- the shared tree -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def first_build(tmp_path_factory):
    """(tree, snakemake output) of the first build, with persist_rotation [true] only."""
    root = copy_repo(tmp_path_factory.mktemp("wf") / "repo")
    return root, smk(root, *config_variant(root, "ci-on", persist_rotation=[True])).stdout


@pytest.fixture(scope="module")
def tree(first_build):
    return first_build[0]


@pytest.fixture(scope="module")
def built(tree):
    """``tree`` after one full run of the CI config (both persist_rotation values), made once for
    the tests that start from it: each that changes the tree restores it and ends with nothing to
    do (``plan(tree, *CI) == {}``), so the next one needs no run of its own."""
    smk(tree, *CI)
    return tree


def test_first_build(first_build):
    tree, output = first_build
    stats = job_stats(output)
    # quantize: the variant, and its rotation-none twin (bench-quality's unrotated arm).
    assert stats["download"] == 1 and stats["quantize"] == 2 and stats["pack"] == 1 and stats["validate"] == 1
    assert stats["report"] == 1
    v = verdict(tree, "on")
    assert v["bit_exact"] is True and v["max_abs_diff"] == 0.0 and v["n_prompts"] >= 1
    assert (v["model"], v["variant"], v["persist_rotation"]) == (MODEL, VARIANT, "on")
    assert (tree / RESERVOIR.format("on") / "model.vqres").is_file()
    for name in ("index.html", "report.md", "summary.json"):
        assert (tree / REPORT / name).stat().st_size > 0
    # Benchmarks ran and their results reached the report.
    assert stats["bench_quality"] == 1 and stats["bench_load"] == 1 and stats["bench_kivi"] == 1
    assert stats["bench_decode"] == 1
    assert json.loads((tree / f"results/bench/{MODEL}/decode.json").read_text())["kind"] == "bench-decode"
    assert json.loads((tree / f"results/bench/{MODEL}/load.json").read_text())["kind"] == "bench-load"
    quality = json.loads((tree / f"results/bench/{MODEL}/quality.json").read_text())
    assert quality["kind"] == "bench-quality" and quality["model"] == MODEL
    summary = json.loads((tree / REPORT / "summary.json").read_text())
    used = {Path(i["path"]).as_posix() for i in summary["inputs"]}
    assert VERDICT.format("on") in used and f"results/bench/{MODEL}/quality.json" in used
    assert f"results/bench/{MODEL}/load.json" in used and f"{RESERVOIR.format('on')}/pack.json" in used
    assert f"results/bench/{MODEL}/decode.json" in used
    # Long stages log their progress: per-layer lines (quantize), per-prompt lines (validate).
    qlog = (tree / f"logs/quantize/{MODEL}/{VARIANT}.log").read_text()
    assert re.search(r"^\[1/\d+\] model\.", qlog, re.M), qlog
    vlog = (tree / f"logs/validate/{MODEL}/{VARIANT}/persist-on.log").read_text()
    assert "[1/" in vlog and "bit-exact" in vlog


def test_second_run_does_nothing(tree):
    proc = smk(tree, "--configfile", "config/ci-on.yaml")
    assert "Nothing to be done" in proc.stdout
    assert job_stats(proc.stdout) == {}


def test_changing_bits_reruns_quantize_and_what_follows(tree):
    stats = plan(tree, *config_variant(tree, "ci-b3", persist_rotation=[True], bits=[3]))
    assert "download" not in stats
    # b3-auto only: the unrotated ablation runs at benchmarks.quality.unrotated_bits (default [4])
    assert stats["quantize"] == 1 and stats["pack"] == 1 and stats["validate"] == 1
    assert "report" in stats


def test_changing_quantize_option_reruns_quantize(tree):
    # An option that is not part of any path is a param: changing it reruns the same job.
    stats = plan(tree, *config_variant(tree, "ci-seed1", persist_rotation=[True], quantize={"seed": 1}))
    assert "download" not in stats
    assert stats["quantize"] == 2 and stats["pack"] == 1 and stats["validate"] == 1  # + b4-none


def test_changing_persist_rotation_reruns_pack_not_quantize(tree):
    stats = plan(tree, *CI)  # persist_rotation: [true, false]
    assert "download" not in stats and "quantize" not in stats
    assert stats["pack"] == 1 and stats["validate"] == 1  # persist-off only
    assert "report" in stats
    before = mtimes(tree, [SOURCE, QUANTIZED, RESERVOIR.format("on")])
    smk(tree, *CI)
    assert mtimes(tree, before) == before
    assert verdict(tree, "off")["bit_exact"] is True
    # Different files: the header records persist_rotation.
    assert sha256(tree / RESERVOIR.format("on") / "model.vqres") != sha256(tree / RESERVOIR.format("off") / "model.vqres")
    assert plan(tree, *CI) == {}


@pytest.mark.parametrize(
    "source, first",
    [
        ("vqpipe/stages/quantize.py", "quantize"),
        ("vqpipe/layers/qlinear.py", "quantize"),
        ("vqpipe/quant/quantize.py", "quantize"),
        ("vqpipe/stages/pack.py", "pack"),
        ("vqpipe/stages/validate.py", "validate"),
        ("vqpipe/stages/report.py", "report"),
        ("vqpipe/report/summary.py", "report"),
        ("vqpipe/report/templates/report.md.j2", "report"),
        ("workflow/schemas/record.schema.json", "report"),
    ],
)
@pytest.mark.usefixtures("built")
def test_editing_a_stage_reruns_it_and_what_follows(tree, source, first):
    restore = edit(tree / source)
    try:
        stats = plan(tree, *CI)
    finally:
        restore()
    order = list(UPSTREAM) + ["report"]
    for rule in order[: order.index(first)]:
        assert rule not in stats, f"editing {source} reruns {rule}: {stats}"
    assert first in stats
    assert "report" in stats
    assert plan(tree, *CI) == {}  # content and mtime restored: nothing to do


@pytest.mark.usefixtures("built")
def test_editing_reservoir_reruns_pack_and_a_killed_run_resumes(tree):
    # One edit serves both checks (a rebuild of everything after pack is the costliest step here):
    # the plan after editing the reservoir code, then that run killed mid-validate and resumed.
    restore = edit(tree / "vqpipe/store/reservoir.py")  # a comment: the artifacts are those of the original
    try:
        stats = plan(tree, *CI)
        assert "download" not in stats and "quantize" not in stats
        assert stats["pack"] == 2 and stats["validate"] == 2 and "report" in stats
        _kill_and_resume(tree, stats)
    finally:
        restore()


def _kill_and_resume(tree, planned):
    quantized_before = mtimes(tree, [SOURCE, QUANTIZED])
    t0 = time.time()
    with open(tree / "killed-run.log", "w") as log:
        proc = subprocess.Popen(SNAKEMAKE + ["--cores", "2", *CI], cwd=tree, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    validate_logs = [tree / f"logs/validate/{MODEL}/{VARIANT}/persist-{p}.log" for p in ("on", "off")]
    deadline = time.time() + 300
    try:
        # Kill everything (snakemake and its jobs) in the middle of a validate job: by then at least
        # one pack job has completed.
        while time.time() < deadline and proc.poll() is None:
            if any(p.exists() and p.stat().st_mtime >= t0 and "loaded" in p.read_text() for p in validate_logs):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed:\n" + (tree / "killed-run.log").read_text()
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert any((tree / ".snakemake/incomplete").iterdir()), "no job was interrupted"
    assert job_stats((tree / "killed-run.log").read_text()) == planned  # it ran what the plan said

    packs = [RESERVOIR.format(p) for p in ("on", "off")]
    complete = [p for p in packs if (tree / p).exists() and os.stat(tree / p).st_mtime >= t0]
    assert complete, "no pack job completed before the kill"
    complete_before = mtimes(tree, complete)
    hashes = {p: sha256(tree / p / "model.vqres") for p in complete}

    smk(tree, "--unlock", *CI)  # a SIGKILLed snakemake leaves its lock behind
    proc = smk(tree, *CI, "--rerun-incomplete")
    stats = job_stats(proc.stdout)
    assert "download" not in stats and "quantize" not in stats
    assert stats.get("pack", 0) == len(packs) - len(complete)  # completed packs are kept
    assert 1 <= stats["validate"] <= 2 and "report" in stats
    assert mtimes(tree, complete) == complete_before
    assert {p: sha256(tree / p / "model.vqres") for p in complete} == hashes
    assert mtimes(tree, quantized_before) == quantized_before
    assert verdict(tree, "on")["bit_exact"] and verdict(tree, "off")["bit_exact"]
    assert plan(tree, *CI) == {}


@pytest.mark.usefixtures("built")
def test_snakemake_report_includes_report_outputs(tree):
    out = tree / "report.html"
    smk(tree, *CI, "--report", str(out))
    html = out.read_text(errors="replace")
    for name in ("report.md", "summary.json", "plots/load_time.png", "tables/validate.html", "tables/kernels.html"):
        assert f"{REPORT}/{name}" in html
    assert VERDICT.format("on") in html
    assert "reproduce the quantize stage" in html and "re-quantizing from the source" in html  # captions
    assert "checked against workflow/schemas/record.schema.json" in html  # a table's caption
    # The zip form holds the embedded results as files: vqpipe's own HTML page is not among them.
    smk(tree, *CI, "--report", str(tree / "report.zip"))
    import zipfile

    names = zipfile.ZipFile(tree / "report.zip").namelist()
    assert any(n.endswith("/report.md") for n in names), names
    assert not any(n.endswith("/index.html") for n in names), names  # one report is not nested in the other


@pytest.mark.usefixtures("built")
def test_bad_round_trip_stops_downstream(tree):
    """validate exits non-zero on a difference: its verdict is removed and the report not rebuilt."""
    ref = tree / QUANTIZED / "reference.safetensors"
    listing = tree / QUANTIZED / "manifest.json"
    original, original_listing = ref.read_bytes(), listing.read_bytes()
    arrays = {k: np.array(v) for k, v in mx.load(str(ref)).items()}
    flat = arrays["logits.0"].reshape(-1)
    flat[0] = np.nextafter(flat[0], np.float32(np.inf), dtype=np.float32)  # one ulp
    mx.save_safetensors(str(ref), {k: mx.array(v) for k, v in arrays.items()})
    # A consistent artifact whose reference differs (not a corrupted copy, which the manifest
    # check would name before comparing: tests/test_cache_faults.py).
    manifest.write(tree / QUANTIZED)
    # The report and the decode benchmark (which measures this reservoir) come after validate.
    report_before = mtimes(tree, [f"{REPORT}/index.html", f"results/bench/{MODEL}/decode.json"])
    try:
        proc = smk(tree, *CI, "--forcerun", "validate", check=False)
        assert proc.returncode != 0
        assert "Error in rule validate" in proc.stdout
        log = (tree / f"logs/validate/{MODEL}/{VARIANT}/persist-on.log").read_text()
        assert "not bit-exact" in log and "prompt 0" in log
        assert not (tree / VERDICT.format("on")).exists()
        assert mtimes(tree, report_before) == report_before
    finally:
        ref.write_bytes(original)
        listing.write_bytes(original_listing)
    # The restored reference passes again (only that verdict: the last test on this tree).
    smk(tree, VERDICT.format("on"), *CI, "--forcerun", "validate")
    assert verdict(tree, "on")["bit_exact"] is True


# --- configuration ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A copy with nothing built (for dry runs and config errors)."""
    return copy_repo(tmp_path_factory.mktemp("bare") / "repo")


@pytest.mark.parametrize(
    "config, key",
    [
        ("models: {tiny: {source: 'synth:tiny'}}\nbits: [5]\n", "bits"),
        ("models: {tiny: {source: 'tiny'}}\nbits: [4]\n", "source"),
        ("models: {tiny: {source: 'synth:tiny'}}\nbits: [4]\nblas: fast\n", "blas"),
        ("models: {tiny: {source: 'synth:tiny'}}\nbits: [4]\nquantize: {dtype: float8}\n", "dtype"),
        ("models: {tiny: {source: 'synth:tiny'}}\nbits: [4]\nbitz: [4]\n", "bitz"),
        ("models: {tiny: {source: 'synth:tiny'}}\n", "bits"),
        ("models: {tiny: {source: 'synth:tiny'}}\nbits: [4]\nquantize: {group_size: 48}\n", "group_size"),
        ("models: {tiny: {source: 'synth:tiny', quantize: {calibration: {text: wiki}}}}\nbits: [4]\n", "text"),
        ("models: {tiny: {source: 'synth:tiny'}}\nbits: [4]\nquantize: {layer_bits: [{match: v, bits: 7}]}\n",
         "layer_bits"),
    ],
)
def test_bad_config_fails_naming_the_key(bare, config, key):
    (bare / "config" / "bad.yaml").write_text(config)
    proc = smk(bare, "--configfile", "config/bad.yaml", check=False)
    assert proc.returncode != 0
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("config")]  # one line, naming the key
    assert re.search(rf"\b{key}\b", line) and "Failed validating" not in proc.stdout, proc.stdout[-2000:]
    assert not (bare / "results").exists() and not (bare / "logs").exists()


def test_default_config_fans_out(bare):
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    n = len(config["models"]) * len(config["bits"]) * len(config.get("rotations", ["auto"]))
    persist = len(config.get("persist_rotation", [True, False]))
    assert len(config["models"]) >= 2 and len(config["bits"]) >= 2
    stats = plan(bare)
    quality = config["benchmarks"]["quality"]
    # bench-quality's unrotated arm: a rotation-none quantize artifact per measured model and width of
    # unrotated_bits (default [4]).
    widths = [b for b in config["bits"] if b in quality.get("unrotated_bits", [4])]
    unrotated = len(quality.get("models", config["models"])) * len(widths) if quality["enabled"] else 0
    assert stats["download"] == len(config["models"])
    assert stats["quantize"] == n + unrotated and stats["pack"] == n * persist and stats["validate"] == n * persist
    assert stats["report"] == 1


def quantize_commands(bare, name, tiny_quantize):
    """The b4 quantize commands a dry run plans for tiny (with ``tiny_quantize`` as its per-model
    quantize override) and for tiny-llama (none): one each."""
    (bare / "config" / f"{name}.yaml").write_text(
        f"models:\n  tiny: {{source: 'synth:tiny', quantize: {tiny_quantize}}}\n"
        "  tiny-llama: {source: 'synth:tiny-llama'}\nbits: [4]\npersist_rotation: [true]\n")
    out = smk(bare, "-n", "-p", "--configfile", f"config/{name}.yaml").stdout
    commands = [line for line in out.splitlines() if " -m vqpipe quantize " in line and "/b4-auto " in line]
    tiny = [c for c in commands if "models/tiny/source" in c]
    llama = [c for c in commands if "models/tiny-llama/source" in c]
    assert len(tiny) == 1 and len(llama) == 1
    return tiny, llama


def test_calibration_options_reach_the_command(bare):
    """A per-model quantize override becomes flags of that model's quantize job only."""
    tiny, llama = quantize_commands(bare, "cal", "{group_size: 64, calibration: {text: text, windows: 4, sequential: true},"
                                                 " budget: {4: 4.75}}")
    assert "--group-size 64 --calibration text --calib-windows 4 --calib-length 512" in tiny[0]
    assert "--sequential" in tiny[0] and "--budget 4.75" in tiny[0] and "--tune-steps auto" in tiny[0]
    # a synth: model is data-free by default (calibration text auto)
    assert "--group-size" not in llama[0] and "--calibration none" in llama[0] and "--budget auto" in llama[0]


def test_layer_bits_reach_the_command(bare):
    """Mixed-width rules (vqpipe/codec/allocate.py) become one quoted JSON flag of that model's quantize jobs."""
    tiny, llama = quantize_commands(bare, "lb", "{layer_bits: [{match: 'v_proj$', add: 1}]}")
    assert """--layer-bits '[{"match":"v_proj$","add":1}]'""" in tiny[0]
    assert "--layer-bits" not in llama[0]


def test_quantize_threads_follow_the_job(bare):
    """The quantize job's cores reach GPTQ's pool (vqpipe/parallel.py) and OpenBLAS alike: one
    each under the default profile, where make run runs two jobs on 2 cores."""
    tiny, _ = quantize_commands(bare, "thr", "{group_size: 64}")
    assert "OPENBLAS_NUM_THREADS=1 " in tiny[0] and " --threads 1 " in tiny[0]


def planned_jobs(output):
    """[(rule, {wildcard: value}, priority)] of a dry run's job blocks, in the order printed."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", output)[1:]:
        rule = re.match(r"(?:local)?rule (\w+):", block).group(1)
        wc = re.search(r"^\s+wildcards: (.*)$", block, re.M)
        prio = re.search(r"^\s+priority: (\d+)$", block, re.M)
        jobs.append((rule, dict(kv.split("=", 1) for kv in wc.group(1).split(", ")) if wc else {},
                     int(prio.group(1)) if prio else 0))
    return jobs


def test_full_precision_calibration_runs_once_per_model(bare):
    """sequential: false -> one calibrate job per model, read by every quantize job of it;
    bench-quality: one reference job, one job per arm and width; the calibrated chain first."""
    (bare / "config" / "fp.yaml").write_text(
        "models:\n  tiny: {source: 'synth:tiny', quantize: {calibration: {text: text, windows: 2, sequential: false}}}\n"
        "  tiny-llama: {source: 'synth:tiny-llama'}\n"
        "bits: [3, 4]\npersist_rotation: [true]\n"
        "benchmarks: {quality: {models: [tiny], affine_groups: [32, 64], competitors: [mlx-gptq, mlx-dwq, mxfp4, nvfp4],"
        " unrotated_bits: [3, 4], dwq_windows: 8},"
        " decode: {models: [tiny-llama]}}\n")
    out = smk(bare, "-n", "-p", "--configfile", "config/fp.yaml").stdout
    stats = job_stats(out)
    assert stats["calibrate"] == 1 and stats["quantize"] == 4 + 2  # tiny b3/b4 x auto/none, tiny-llama b3/b4
    # 2 widths x (vqpipe, unrotated, affine-g32, -g64, mlx-gptq, mlx-dwq) + mxfp4 and nvfp4 at 4 bits only
    # (MLX refuses 3: no job, the merge records the refusal; --expect lists every arm asked for)
    assert stats["bench_quality_reference"] == 1 and stats["bench_quality_arm"] == 2 * 6 + 2 and stats["bench_quality"] == 1
    assert not re.search(r"--bits 3 --arms (mx|nv)fp4", out)
    merge = next(line for line in out.splitlines() if " --merge " in line)
    assert "--expect 3:vqpipe 3:unrotated 3:affine-g32 3:affine-g64 3:mlx-gptq 3:mlx-dwq 3:mxfp4 3:nvfp4 4:vqpipe" in merge
    commands = [line for line in out.splitlines() if " -m vqpipe quantize " in line and "models/tiny/" in line]
    assert len(commands) == 4 and all("--moments results/calibration/tiny" in c for c in commands)
    assert not any("--calibration" in c for c in commands)
    assert "--calib-windows 2" in next(line for line in out.splitlines() if " -m vqpipe calibrate " in line)
    arms = [line for line in out.splitlines() if " -m vqpipe bench-quality " in line and " --arms " in line]
    assert sum("--arms affine-g32 " in a and "--quantized  --embeddings" in a for a in arms) == 2  # no artifact
    assert sum("--arms unrotated " in a and "--quantized results/quantized/tiny/b3-none " in a for a in arms) == 1
    # the mlx-lm arms calibrate on the calibrate stage's windows (tiny: 2), both texts measured
    gptq = [a for a in arms if "--arms mlx-gptq " in a]
    assert len(gptq) == 2 and all("--calib-windows 2 --calib-length 512 --calib-seed 0" in a for a in gptq)
    dwq = [a for a in arms if "--arms mlx-dwq " in a]
    assert len(dwq) == 2 and all("--calib-seed 0 --dwq-windows 8 " in a for a in dwq)
    assert all("--texts devil jargon" in a for a in arms)
    # the calibrated model's chain, then what needs only a source and bench-decode's reservoir, then the rest
    prio = {(rule, w.get("model"), w.get("bits"), w.get("arm")): p for rule, w, p in planned_jobs(out)}
    assert prio[("download", "tiny", None, None)] == prio[("calibrate", "tiny", None, None)] == 100
    assert prio[("quantize", "tiny", "3", None)] == 99 and prio[("bench_quality_arm", "tiny", "4", "unrotated")] == 98
    assert prio[("bench_quality_reference", "tiny", None, None)] == prio[("bench_quality_arm", "tiny", "4", "affine-g64")] == 50
    assert prio[("quantize", "tiny-llama", "4", None)] == prio[("validate", "tiny-llama", "4", None)] == 50  # bench-decode's
    assert prio[("bench_decode", "tiny-llama", None, None)] == prio[("bench_load", "tiny", None, None)] == 50
    assert prio[("quantize", "tiny-llama", "3", None)] == prio[("validate", "tiny", "4", None)] == 0
    assert prio[("bench_kivi", None, None, None)] == 50  # bench-decode reads its flush times
    assert prio[("report", None, None, None)] == 0


def test_residual_rotation_reaches_calibrate_and_quantize(bare):
    """residual_rotation: the calibrate job collects the rotated model's moments and, for bench-quality's
    unrotated arm, the plain model's; the auto quantize jobs fold the rotation in, the none job does not."""
    (bare / "config" / "res.yaml").write_text(
        "models:\n  tiny: {source: 'synth:tiny', quantize: {residual_rotation: true,"
        " calibration: {text: text, windows: 2, sequential: false}}}\n"
        "  tiny-llama: {source: 'synth:tiny-llama'}\n"
        "bits: [4]\npersist_rotation: [true]\nbenchmarks: {quality: {models: [tiny], affine_groups: [64]}}\n")
    out = smk(bare, "-n", "-p", "--configfile", "config/res.yaml").stdout
    lines = out.splitlines()
    cal = [line for line in lines if " -m vqpipe calibrate " in line]
    assert len(cal) == 1 and "--calib-seed 0 --residual-rotation auto --seed 0 --plain >" in cal[0]
    quant = {m.group(1): line for line in lines if (m := re.search(r" -m vqpipe quantize .*/(tiny(?:-llama)?/b4-\w+) ", line))}
    assert set(quant) == {"tiny/b4-auto", "tiny/b4-none", "tiny-llama/b4-auto"}
    assert "--residual-rotation" in quant["tiny/b4-auto"] and "--moments results/calibration/tiny" in quant["tiny/b4-auto"]
    assert "--residual-rotation" not in quant["tiny/b4-none"] and "--moments" in quant["tiny/b4-none"]
    assert "--residual-rotation" not in quant["tiny-llama/b4-auto"]
    (bare / "config" / "res2.yaml").write_text(
        "models: {tiny: {source: 'synth:tiny', quantize: {residual_rotation: true}}}\nbits: [4]\nrotations: [auto, qr]\n")
    proc = smk(bare, "-n", "--configfile", "config/res2.yaml", check=False)
    assert proc.returncode != 0 and "residual_rotation, which needs rotations" in proc.stdout


def test_slurm_profile_dry_run(bare):
    proc = smk(bare, "-n", "--profile", "workflow/profiles/slurm", *CI,
               env={**os.environ, "SLURM_ACCOUNT": "acct", "SLURM_PARTITION": "cpu"})
    stats = job_stats(proc.stdout)
    assert stats["quantize"] == 2 and stats["pack"] == 2  # b4-auto, b4-none
    out = proc.stdout
    assert "slurm_partition=cpu" in out and "slurm_account=acct" in out
    # Resources come from their one place, the workflow profile, on top of the slurm profile.
    assert "workflow specific profile workflow/profiles/default" in out
    want = yaml.safe_load((bare / "workflow/profiles/default/config.yaml").read_text())["set-resources"]["quantize"]
    quantize_block = out[out.index("rule quantize:"):].split("\n\n")[0]
    assert f"mem_mb={want['mem_mb']}" in quantize_block and f"runtime={want['runtime']}" in quantize_block


# --- sharing artifacts -----------------------------------------------------------------------------


def test_between_workflow_cache(tmp_path):
    """Two clones, one SNAKEMAKE_OUTPUT_CACHE: the second runs no download, quantize or pack job."""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(cache)}
    targets = [VERDICT.format(p) for p in ("on", "off")]
    a = copy_repo(tmp_path / "clone-a")
    # Checked out later (newer source files) and from clone-a, so the sources are the same even
    # while someone edits the repository during the test.
    b = copy_repo(tmp_path / "clone-b", keep_mtimes=False, src=a)
    smk(a, *targets, *CI, "--cache", env=env)
    assert len(list(cache.iterdir())) == 4  # download, quantize, pack on, pack off

    proc = smk(b, *targets, *CI, "--cache", env=env)
    stats = job_stats(proc.stdout)
    assert stats["validate"] == 2 and "report" not in stats  # only the targets' jobs
    for rel, log in [
        (SOURCE, f"logs/download/{MODEL}.log"),
        (QUANTIZED, f"logs/quantize/{MODEL}/{VARIANT}.log"),
        (RESERVOIR.format("on"), f"logs/pack/{MODEL}/{VARIANT}/persist-on.log"),
        (RESERVOIR.format("off"), f"logs/pack/{MODEL}/{VARIANT}/persist-off.log"),
    ]:
        # The stage never ran (an empty log at most) and its output comes from the cache.
        assert not (b / log).exists() or (b / log).stat().st_size == 0, (b / log).read_text()
        assert (a / log).stat().st_size > 0
        files = artifact_files(b, rel)
        assert files and all(f.resolve().is_relative_to(cache.resolve()) for f in files)
    assert f"Symlinking output file {RESERVOIR.format('on')}" in proc.stdout
    on, off = (b / RESERVOIR.format(p) / "model.vqres" for p in ("on", "off"))
    assert on.resolve() != off.resolve()
    assert sha256(on) != sha256(off)
    assert json.loads((b / RESERVOIR.format("off") / "pack.json").read_text()).get("persist_rotation") in (False, "off")
    assert verdict(b, "on")["bit_exact"] and verdict(b, "off")["bit_exact"]
    assert plan(b, *targets, *CI, "--cache", env=env) == {}


def test_fs_storage_plugin(tmp_path):
    """Artifacts live in a remote store (snakemake-storage-plugin-fs, rsync); another checkout sees them."""
    if shutil.which("rsync") is None:
        pytest.fail("rsync is missing (scripts/setup.sh installs it)")
    store = tmp_path / "store"
    env = {**os.environ, "VQPIPE_STORE": str(store)}
    profile = ["--profile", "workflow/profiles/fs-store"]
    targets = [VERDICT.format(p) for p in ("on", "off")]
    a = copy_repo(tmp_path / "a")
    smk(a, *targets, *profile, *CI, env=env)
    for p in ("on", "off"):
        assert (store / RESERVOIR.format(p) / "model.vqres").is_file()
        assert json.loads((store / VERDICT.format(p)).read_text())["bit_exact"] is True
    assert (store / QUANTIZED / "reference.safetensors").is_file()
    assert (store / f"logs/quantize/{MODEL}/{VARIANT}.log").stat().st_size > 0
    assert not (a / "results").exists()  # nothing but the local storage cache in the checkout
    assert plan(a, *targets, *profile, *CI, env=env) == {}

    # A second checkout of the same sources (copied with their times, like rsync -a) with no local
    # state at all sees the artifacts in the store as up to date.
    b = copy_repo(tmp_path / "b", src=a)
    assert plan(b, *targets, *profile, *CI, env=env) == {}
