"""A fuzz campaign runner: seeded cases run in worker processes, watched for crashes and hangs.

A *target* module provides ``prepare(workdir)`` (builds its base inputs once, returns a context)
and ``run_case(ctx, seed, index)`` -> ``(outcome, detail)``. Case ``index`` of seed ``seed`` is
the same mutation on every machine, so any case can be replayed alone (``--case``).

The parent process never imports the target: it starts one worker at a time
(``python -m experiments.fuzz worker ...``), reads one JSON line per finished case, and counts a case
as ``crash`` when the worker dies in it (a signal, a non-zero exit) and as ``hang`` when it
finishes nothing for ``timeout`` seconds (the worker is then killed). Either way the next worker
resumes after the bad case, so one crash does not end a campaign.
"""

import argparse
import importlib
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from collections import Counter

from experiments import child_env

FAILURES = ("other", "wrong-model", "unusable", "crash", "hang")


def _worker(target, seed, start, end, workdir, mem_limit):
    if mem_limit:
        # A header that makes the reader allocate without bound hits this and shows as a failure
        # (MemoryError or a crash), instead of taking the machine down.
        resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
    # Results go to the original stdout; anything the target prints (Python or native) to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    mod = importlib.import_module(target)
    ctx = mod.prepare(workdir)
    for i in range(start, end):
        try:
            outcome, detail = mod.run_case(ctx, seed, i)
        except MemoryError as e:  # the case asked for too much memory: a failure, keep going
            outcome, detail = "other", f"MemoryError: {e}"
        out.write(json.dumps({"i": i, "outcome": outcome, "detail": detail}) + "\n")
        out.flush()
    return 0


def _spawn(target, seed, start, end, workdir, mem_limit):
    cmd = [sys.executable, "-m", "experiments.fuzz", "worker", "--target", target, "--seed", str(seed),
           "--start", str(start), "--end", str(end), "--workdir", str(workdir),
           "--mem-limit", str(mem_limit)]
    err = open(os.path.join(workdir, "worker.stderr"), "w+")  # a file: a pipe could fill and block
    # Unbuffered: select() must see every byte not yet parsed (a buffered reader could hold lines).
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, bufsize=0, start_new_session=True,
                            env=child_env())


def _tail(workdir, n=600):
    with open(os.path.join(workdir, "worker.stderr"), errors="replace") as f:
        return f.read()[-n:].strip()


def _kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _run_batch(target, seed, start, end, workdir, timeout, mem_limit, record, prepare_timeout):
    """Run cases [start, end) in one worker; returns the first index not yet run."""
    proc = _spawn(target, seed, start, end, workdir, mem_limit)
    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    nxt, limit, buf = start, prepare_timeout, b""
    while nxt < end:
        if b"\n" not in buf:
            if not sel.select(limit):
                _kill(proc)
                record(nxt, "hang", f"no result within {limit:.0f} s")
                return nxt + 1
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the worker exited
                rc = proc.wait()
                record(nxt, "crash", f"worker exited with {rc} during the case: {_tail(workdir)}")
                return nxt + 1
            buf += chunk
            continue
        line, buf = buf.split(b"\n", 1)
        r = json.loads(line)
        record(r["i"], r["outcome"], r["detail"])
        nxt, limit = r["i"] + 1, timeout
    proc.stdout.close()
    rc = proc.wait()
    if rc:
        record(end - 1, "crash", f"worker exited with {rc} after its last case")
    return end


def campaign(target, seed, n, workdir, batch=5000, timeout=60.0, mem_limit=8 << 30,
             prepare_timeout=600.0, progress=None, start=0):
    """Run cases [start, start + n) of ``target``; returns a summary dict (counts, failures, wall)."""
    os.makedirs(workdir, exist_ok=True)
    counts, failures, t0 = Counter(), [], time.perf_counter()

    def record(i, outcome, detail):
        counts[outcome] += 1
        if outcome in FAILURES and len(failures) < 200:
            failures.append({"case": i, "outcome": outcome, "detail": detail})
            if progress:
                progress(f"FAILURE case {i}: {outcome}: {detail[-300:]}")

    i, end, last = start, start + n, time.perf_counter()
    while i < end:
        i = _run_batch(target, seed, i, min(end, i + batch), workdir, timeout, mem_limit, record,
                       prepare_timeout)
        if progress and time.perf_counter() - last > 30:
            last = time.perf_counter()
            progress(f"{i - start}/{n} cases, {dict(counts)}, {last - t0:.0f} s")
    wall = time.perf_counter() - t0
    return {
        "target": target, "seed": seed, "start": start, "cases": sum(counts.values()),
        "counts": dict(sorted(counts.items())), "failed": sum(counts[f] for f in FAILURES),
        "failures": failures, "wall_s": round(wall, 1),
    }


def run_one(target, seed, index, workdir):
    """Replay one case in this process (for debugging): ``(outcome, detail)``."""
    mod = importlib.import_module(target)
    return mod.run_case(mod.prepare(workdir), seed, index)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.fuzz")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--target", required=True)
    w.add_argument("--seed", type=int, required=True)
    w.add_argument("--start", type=int, required=True)
    w.add_argument("--end", type=int, required=True)
    w.add_argument("--workdir", required=True)
    w.add_argument("--mem-limit", type=int, default=0)
    args = p.parse_args(argv)
    return _worker(args.target, args.seed, args.start, args.end, args.workdir, args.mem_limit)


if __name__ == "__main__":
    sys.exit(main())
