"""Time to a usable model in a fresh process, as a user's `vqpipe generate` or `mlx_lm.generate` pays it.

Each sample is a new interpreter that imports, loads (``vqpipe.load`` for a reservoir,
``mlx_lm.load`` for a model directory), evaluates every parameter and then the logits of one
token, timing the three phases apart; the figure compared is their sum (the interpreter's own
start is the same for every arm and left out). Arms run interleaved (A B C A' ..., A' a second copy of the
first arm for the A/A noise floor); the page cache is warm for every arm alike after the first round,
which is untimed.
"""

import json
import os
import subprocess
import sys

from .harness import AA_SUFFIX, compare, noise_floor, summarize

# The child is a program of its own: nothing of vqpipe or MLX is imported before its clock starts.
_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import mlx.core as mx
kind, path = sys.argv[1:]
if kind == "vqpipe":
    import vqpipe  # its loader's own modules are imported by vqpipe.load: "load" counts them
    loader = vqpipe.load
else:
    from mlx_lm.utils import load as loader
t1 = time.perf_counter()
model, _ = loader(path)
mx.eval(model.parameters())
t2 = time.perf_counter()
mx.eval(model(mx.array([[1]], dtype=mx.int32)))
mx.synchronize()
t3 = time.perf_counter()
hwm = None
try:
    hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
except (OSError, StopIteration):
    pass
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_logits_s": t3 - t2, "seconds": t3 - t0,
                  "mlx_peak_bytes": mx.get_peak_memory(), "vm_hwm_bytes": hwm}))
"""
KINDS = ("vqpipe", "mlx_lm")


def sample(kind, path, timeout=600):
    """One fresh-process sample of ``child``; a failed child raises with its stderr's tail."""
    if kind not in KINDS:
        raise ValueError(f"unknown loader {kind!r}; choose one of {', '.join(KINDS)}")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}  # a warning is not part of the time
    proc = subprocess.run([sys.executable, "-c", _CHILD, kind, str(path)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"loading {path} ({kind}) in a fresh process failed ({proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(arms, repeats, progress=print):
    """``arms``: ``{name: (kind, path)}``, the first the baseline. One untimed round, then ``repeats``
    interleaved rounds with an A/A copy of the baseline. Returns ``(records, comparisons, floor)``:
    per arm the medians of each phase, and every arm's total against the baseline's."""
    if not arms or repeats < 1:
        raise ValueError("need at least one arm and repeats >= 1")
    base = next(iter(arms))
    order = {**arms, base + AA_SUFFIX: arms[base]}
    for name, (kind, path) in arms.items():
        sample(kind, path)  # untimed: the page cache, the interpreter's own files
    samples = {name: [] for name in order}
    for r in range(repeats):
        for name, (kind, path) in order.items():
            samples[name].append(sample(kind, path))
        progress(f"fresh-process loads, round {r + 1}/{repeats}: "
                 + ", ".join(f"{n} {s[-1]['seconds']:.2f}s" for n, s in samples.items()))
    floor = noise_floor([x["seconds"] for x in samples[base]], [x["seconds"] for x in samples[base + AA_SUFFIX]])
    records = []
    for name, (kind, path) in arms.items():
        xs = samples[name]
        rec = {"arm": name, "loader": kind, "path": str(path), **summarize(x["seconds"] for x in xs)}
        for key in ("import_s", "load_s", "first_logits_s"):
            rec[key] = summarize(x[key] for x in xs)
        rec["mlx_peak_bytes"] = summarize(x["mlx_peak_bytes"] for x in xs)
        hwm = [x["vm_hwm_bytes"] for x in xs if x["vm_hwm_bytes"] is not None]
        rec["vm_hwm_bytes"] = summarize(hwm) if hwm else None
        records.append(rec)
    comparisons = [{"kind": "fresh-load", "baseline_arm": base, "other_arm": name,
                    **compare([x["seconds"] for x in samples[base]], [x["seconds"] for x in samples[name]], floor)}
                   for name in arms if name != base]
    return records, comparisons, floor
