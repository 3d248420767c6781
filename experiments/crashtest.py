"""SIGKILL campaigns for the download, quantize and pack stages (scripts/crashtest.py).

Each trial runs a stage CLI in a child process and kills it with SIGKILL at a seeded point:
either after a random delay within the stage's measured run time, or at the N-th file-system
event (before or after a call to open-for-write, write_text, mkstemp/mkdtemp, fsync, rename,
exchange, unlink, rmtree, copy, chmod or save_safetensors). Then it checks that

1. the output path is absent, or complete and correct: its manifest verifies and every payload
   file is byte-identical to the golden artifact (the stages are deterministic, and the golden
   reservoir was validated bit-exact), never partial or wrong;
2. the next, unkilled run of the same command completes, its output equals the golden artifact,
   and no temporary file or directory of any writer is left next to it. (With ``recover_every``
   k > 1 this run follows every k-th kill only; the other kills are followed by the next trial's
   killed run, so kills also land on the leftovers of earlier kills.)

Half the trials start with the output already present (the replace path), half without.
"""

import builtins
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from experiments import child_env
from vqpipe.store import manifest

# Files whose bytes legitimately differ between runs (timings, peak RSS, environment); the rest
# of an artifact must be byte-identical to the golden one.
VOLATILE = {"quantized.json", "reference.json", "pack.json", "vqpipe-source.json", manifest.NAME}
STAGES = ("download", "quantize", "pack")


def commands(work, stage):
    """(argv after `python -m vqpipe`, output path) of ``stage`` in ``work``."""
    work = Path(work)
    if stage == "download":
        return ["download", "--source", "synth:tiny", "--out", str(work / "out" / "source")], work / "out" / "source"
    if stage == "quantize":
        return ["quantize", "--source", str(work / "golden" / "source"), "--out", str(work / "out" / "q"),
                "--bits", "4"], work / "out" / "q"
    return ["pack", "--quantized", str(work / "golden" / "q"), "--out", str(work / "out" / "r"),
            "--persist-rotation", "off"], work / "out" / "r"


# --- the child: a stage CLI that kills itself at file-system event N --------------------------


def _install(kill_at, counter):
    import mlx.core as mx

    from vqpipe.store import fsutil

    def event():
        counter[0] += 1
        if counter[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(owner, name, writes_only=False):
        real = getattr(owner, name)

        def hooked(*args, **kwargs):
            mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
            hit = not writes_only or any(c in str(mode) for c in "wax+")
            if hit:
                event()
            out = real(*args, **kwargs)
            if hit:
                event()
            return out

        setattr(owner, name, hooked)

    for name in ("replace", "rename", "fsync", "unlink", "mkdir", "chmod", "truncate", "ftruncate"):
        wrap(os, name)
    for name in ("copyfile", "copy2", "copytree", "rmtree"):
        wrap(shutil, name)
    for name in ("mkstemp", "mkdtemp"):
        wrap(tempfile, name)
    for name in ("write_text", "write_bytes"):
        wrap(pathlib.Path, name)
    wrap(builtins, "open", writes_only=True)
    wrap(fsutil, "_exchange")
    wrap(mx, "save_safetensors")


def child(kill_at, count_file, argv):
    # The BLAS comes from the environment this process started in, as for `python -m vqpipe`.
    counter = [0]
    _install(kill_at, counter)
    from vqpipe.__main__ import main

    rc = main(argv)
    if count_file:
        Path(count_file).write_text(str(counter[0]))
    return rc


def _run_child(argv, kill_at=0, delay=None, count_file=None, timeout=600):
    """Run the stage in a child; returns (exit status, killed by us?, seconds)."""
    cmd = [sys.executable, "-m", "experiments.crashtest", "child", "--kill-at", str(kill_at)]
    cmd += ["--count-file", str(count_file)] if count_file else []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd + ["--", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=child_env())
    try:
        proc.wait(timeout=delay if delay is not None else timeout)
    except subprocess.TimeoutExpired:
        if delay is None:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{argv[0]} did not finish within {timeout} s")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    err = proc.stderr.read()
    proc.stderr.close()
    if proc.returncode not in (0, -signal.SIGKILL):
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {err[-2000:]}")
    return proc.returncode, time.perf_counter() - t0


# --- checks ------------------------------------------------------------------------------------


def payload(directory):
    """{relative name: bytes} of an artifact's files that must not change between runs."""
    directory = Path(directory)
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name not in VOLATILE and not p.name.startswith(".")}


def check_output(out, golden):
    """``"absent"``, ``"complete"``, or a failure string saying what is wrong with ``out``."""
    out = Path(out)
    if not out.exists():
        return "absent"
    try:
        if not manifest.verify(out):
            return "wrong: no manifest"
    except manifest.ManifestError as e:
        return f"wrong: {e}"
    got = payload(out)
    if got.keys() != golden.keys():
        return f"wrong: files {sorted(got.keys() ^ golden.keys())}"
    bad = [k for k in got if got[k] != golden[k]]
    if bad:
        return f"wrong: {bad} differ from the golden artifact"
    for name in VOLATILE & {p.name for p in out.iterdir()}:
        if name.endswith(".json"):
            json.loads((out / name).read_text())
    return "complete"


def temps_next_to(out):
    return sorted(p.name for p in Path(out).parent.iterdir() if p.name.startswith(f".{Path(out).name}."))


# --- the campaign ---------------------------------------------------------------------------


def prepare(work):
    """Build the golden source, quantize and pack artifacts (unkilled children); returns
    {stage: (golden payload, run seconds, file-system events)}."""
    work = Path(work)
    out = {}
    for stage, golden in (("download", "source"), ("quantize", "q"), ("pack", "r")):
        argv, path = commands(work, stage)
        shutil.rmtree(path, ignore_errors=True)
        count = work / f"{stage}.events"
        _, seconds = _run_child(argv, count_file=count)
        shutil.rmtree(work / "golden" / golden, ignore_errors=True)
        (work / "golden").mkdir(parents=True, exist_ok=True)
        os.replace(path, work / "golden" / golden)
        out[stage] = (payload(work / "golden" / golden), seconds, int(count.read_text()))
    return out


def trial(work, stage, golden, rng, recover=True):
    """One kill (+ the recovery run); returns (Counter of outcomes, failure message or None)."""
    payload_, seconds, events = golden
    argv, out = commands(work, stage)
    c = Counter()
    if rng.random() < 0.5:
        shutil.rmtree(out, ignore_errors=True)
        c["started-without-output"] += 1
    if rng.random() < 0.5:
        rc, _ = _run_child(argv, kill_at=rng.randrange(1, events + 1))
        c["kill-at-event"] += 1
    else:
        rc, _ = _run_child(argv, delay=rng.uniform(0.0, seconds * 1.1))
        c["kill-after-delay"] += 1
    c["killed" if rc else "finished-before-kill"] += 1
    state = check_output(out, payload_)
    if state not in ("absent", "complete"):
        return c, f"after the kill: {state}"
    c[f"after-kill-{state}"] += 1
    c["temps-left-by-kill"] += bool(temps_next_to(out))
    if not recover:
        return c, None
    rc, _ = _run_child(argv)
    state = check_output(out, payload_)
    if rc or state != "complete":
        return c, f"the next run: exit {rc}, output {state}"
    left = temps_next_to(out)
    if left:
        return c, f"the next run left temporaries: {left}"
    c["recovered"] += 1
    return c, None


def campaign(stage, n, seed, work=None, progress=None, golden=None, recover_every=1, start=0):
    """Seeded trials [start, start + n) of ``stage`` (the last one always recovers); ``golden``: a
    ``prepare(work)`` result to reuse. Trial i is the same kill on every run: split a campaign over
    processes with ``start``."""
    work = Path(work or tempfile.mkdtemp(prefix="vqpipe-crash-"))
    t0 = time.perf_counter()
    golden = golden or prepare(work)
    counts, failures = Counter(), []
    for i in range(start, start + n):
        recover = (i + 1) % recover_every == 0 or i == start + n - 1
        c, failure = trial(work, stage, golden[stage], random.Random(f"crash:{stage}:{seed}:{i}"), recover)
        counts.update(c)
        if failure:
            failures.append({"trial": i, "failure": failure})
        if progress and (i + 1 - start) % 20 == 0:
            progress(f"{stage}: {i + 1 - start}/{n} trials, {len(failures)} failures, {time.perf_counter() - t0:.0f} s")
    return {"stage": stage, "seed": seed, "start": start, "trials": n, "counts": dict(sorted(counts.items())),
            "failures": failures, "golden_seconds": round(golden[stage][1], 2),
            "golden_events": golden[stage][2], "recover_every": recover_every,
            "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        sep = argv.index("--")
        opts = dict(zip(argv[1:sep:2], argv[2:sep:2]))
        return child(int(opts.get("--kill-at", 0)), opts.get("--count-file"), argv[sep + 1:])
    raise SystemExit("usage: python -m experiments.crashtest child --kill-at N [--count-file F] -- STAGE ARGS")


if __name__ == "__main__":
    sys.exit(main())
