"""Where a decode step's GPU time goes, kernel by kernel (run under Nsight Compute).

The step attribution (experiments/step_attribution.py) gives one GPU time per step; this says which
kernels make it up. One process per arm builds a preset's model in device memory as
experiments/decode_shapes.py does, warms a compiled decode step, then runs ``--steps`` steps between
``cuProfilerStart`` and ``cuProfilerStop`` (the driver API), each step synchronized, so Nsight
Compute started with ``--profile-from-start off`` records exactly those steps' kernels:

    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --print-kernel-base function --csv --log-file K.csv \\
        python -m experiments.step_kernels --preset qwen2.5-0.5b --arm vqpipe-b4+s
    python -m experiments.step_kernels --summarize K.csv --steps 3 --out K.json

Nsight Compute runs kernels one at a time (no overlap, no launch gaps), with the real clocks and
warm caches as asked above: the sum per step is the device time of the step's kernels, and the
step's GPU time measured without the profiler minus that sum is what the gaps between kernels
cost. Kernel names are grouped into families (a trailing source digest dropped).
"""

import argparse
import csv
import ctypes
import re
import sys

from vqpipe.store.fsutil import write_json


def family(name):
    """A kernel's family: its base name without a trailing hex digest (vqpipe's kernels carry one)."""
    return re.sub(r"_[0-9a-f]{6,}$", "", name.strip())


def read_ncu_csv(path):
    """(kernel name, grid, block, µs) per profiled kernel from Nsight Compute's CSV (``--csv`` with
    ``gpu__time_duration.sum``; lines before the header, ncu's own log, are skipped)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError(f"{path}: no Nsight Compute CSV header (a line starting with \"ID\")")
    rows = []
    for r in csv.DictReader(lines[start:]):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(r["Metric Unit"], None)
        if scale is None:
            raise ValueError(f"{path}: unexpected unit {r['Metric Unit']!r} for gpu__time_duration.sum")
        name = r.get("Kernel Name") or r.get("Function Name") or r.get("Demangled Name") or "?"
        rows.append((name, r.get("Grid Size", ""), r.get("Block Size", ""), float(r["Metric Value"].replace(",", "")) * scale))
    if not rows:
        raise ValueError(f"{path}: no gpu__time_duration.sum rows")
    return rows


def summarize(rows, steps):
    """Per family: kernels and µs per step (median-free: Nsight Compute's per-kernel figure summed
    over the profiled steps, divided by ``steps``), sorted by time."""
    fams = {}
    for name, grid, block, us in rows:
        f = fams.setdefault(family(name), {"kernels": 0, "us": 0.0, "shapes": set()})
        f["kernels"] += 1
        f["us"] += us
        f["shapes"].add(f"{grid}x{block}")
    out = [{"family": k, "kernels_per_step": v["kernels"] / steps, "us_per_step": v["us"] / steps,
            "us_per_kernel": v["us"] / v["kernels"], "launch_shapes": sorted(v["shapes"])[:6]}
           for k, v in fams.items()]
    out.sort(key=lambda r: -r["us_per_step"])
    return {"steps": steps, "kernels_per_step": len(rows) / steps, "us_per_step": sum(r[3] for r in rows) / steps,
            "families": out}


def table(summary):
    lines = [f"{summary['kernels_per_step']:.0f} kernels, {summary['us_per_step']:.1f} µs per step (device time, serialized)"]
    for r in summary["families"]:
        lines.append(f"  {r['us_per_step']:8.1f} µs  {r['kernels_per_step']:5.0f} x {r['us_per_kernel']:6.2f} µs  {r['family'][:90]}")
    return "\n".join(lines)


def profile(preset, arm, context, steps, warmup, nofuse=False):
    import mlx.core as mx

    from experiments import decode_shapes as ds

    base = ds.model_arm(arm)
    if base == "bf16":
        model = ds.random_full(preset)
    elif base == "affine4":
        model = ds.affine(ds.random_full(preset), preset)
    elif base.startswith("vqpipe-b"):
        model = ds.random_vqpipe(preset, int(base.removeprefix("vqpipe-b")))
        if nofuse:  # q/k/v and gate/up as separate launches: the fused kernels' cost apart
            from vqpipe.layers.fused import unfuse_model

            unfuse_model(model)
    else:
        raise ValueError(f"arm {arm!r}: expected bf16, affine4 or vqpipe-bN with a decode-mode suffix (+s, +c)")
    mode = ds.decode_mode(arm)
    if mode is None:
        raise ValueError(f"arm {arm!r}: only compiled steps (+s, +c) are profiled")
    vocab = ds.synth.make_config(preset)["vocab_size"]
    prompt = mx.random.randint(0, vocab - 16, (context,), key=mx.random.key(7))
    step = ds._compiled_step(model, prompt, warmup + steps + 2, mode)
    for _ in range(warmup):
        mx.eval(step())
    mx.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for _ in range(steps):
        mx.eval(step())
        mx.synchronize()
    cuda.cuProfilerStop()
    print(f"profiled {steps} steps of {arm} ({preset}, context {context}, fused {not nofuse})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--arm", default="vqpipe-b4+s")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--nofuse", action="store_true", help="vqpipe arms: undo the q|k|v and gate|up fusion")
    p.add_argument("--summarize", metavar="CSV", help="summarize an Nsight Compute CSV instead of profiling")
    p.add_argument("--out", help="with --summarize: write the summary as JSON")
    args = p.parse_args(argv)
    if args.summarize:
        s = summarize(read_ncu_csv(args.summarize), args.steps)
        print(table(s))
        if args.out:
            write_json(args.out, {"kind": "step-kernels", "csv": args.summarize, **s})
        return 0
    profile(args.preset, args.arm, args.context, args.steps, args.warmup, args.nofuse)
    return 0


if __name__ == "__main__":
    sys.exit(main())
