"""bench-kivi: op-level timing of one KIVI flush, fused kernel vs the MLX-ops reference.

For each sequence length S (tokens flushed at once) and each of keys, values and a whole flush
(keys + values: one fused launch, as the cache runs it), the kernel and the reference run
interleaved in one process on a rotating pool of distinct inputs [1, H, S, D], with warm-up, each
sample timed through ``mx.eval`` and ``mx.synchronize``; a second copy of each arm gives the A/A
noise floor. Two modes:

- ``isolated``: one flush per timed step, so each sample carries a whole eval + synchronize;
- ``in_graph``: ``--layers`` flushes (distinct inputs) per step, as a decode step of the cache runs
  one flush per layer inside one graph; per-flush figures are step time / layers.

The kernel's effective bandwidth (x read once, x_hat, scale and zero written once, over the median
per-flush time) is set against the measured copy bandwidth. Without a Metal/CUDA backend only the
reference is timed.

``--layouts vec warp`` times each named kernel layout (see :mod:`vqpipe.kivi.kernels`) as its own
arm, interleaved with the reference in the same run and each with its A/A copy: the first layout is
the "kernel" arm (the top-level speedup, verdict and M4 comparison of each row), the others are
"kernel:<layout>"; every row then also carries ``layouts``, per layout: speedup, verdict, bandwidth
and (isolated mode) whether its outputs equal the reference's. Without the option only the
current layout (``kernels.layout()``, "vec") is timed.

    vqpipe bench-kivi --out results/bench/kivi_ops.json
"""

import argparse
import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten

from ..store import record
from ..kivi import kernels, quantizer
from ..bench import env, harness, roofline

# Speedups of the fused kernels over the MLX-ops reference in the original experiment (Apple M4),
# as given in the KIVI issue; not measured here.
M4_RATIOS = {32: 1.40, 2048: 5.65}
# flush: keys + values with scale and zero (one fused launch, six outputs); cache_flush: the flush as
# KIVICache runs it, x_hat only (one launch, two outputs; the reference computes the same x_hat).
KINDS = ("keys", "values", "flush", "cache_flush")


def _arm_name(layouts, layout):
    return "kernel" if layout == layouts[0] else f"kernel:{layout}"


def _arms(kind, pool, bits, g, per_step, layouts=None):
    """{"reference": fn(i), "kernel": fn(i) if kernels are active}; each call does ``per_step``
    flushes on consecutive, distinct inputs of the pool. A whole flush is one fused launch.
    With ``layouts``, one kernel arm per layout: "kernel" (the first), "kernel:<name>" (the rest)."""
    n = len(pool["keys"])
    ref = {"keys": quantizer.fake_quant_keys, "values": quantizer.fake_quant_values}

    def reference(i):
        if kind == "cache_flush":
            return [ref[p](pool[p][(i + j) % n], bits, g)[0] for j in range(per_step) for p in ("keys", "values")]
        parts = ("keys", "values") if kind == "flush" else (kind,)
        return [ref[p](pool[p][(i + j) % n], bits, g) for j in range(per_step) for p in parts]

    def kernel_arm(layout):
        def kernel(i):
            out = []
            for j in range(per_step):
                k, v = pool["keys"][(i + j) % n], pool["values"][(i + j) % n]
                if kind == "flush":
                    out += kernels.fake_quant_kv(k, v, bits, g, use_kernels=True, layout=layout)
                elif kind == "cache_flush":
                    out += kernels.fake_quant_kv_hat(k, v, bits, g, use_kernels=True, layout=layout)
                elif kind == "keys":
                    out.append(kernels.fake_quant_keys(k, bits, g, use_kernels=True, layout=layout))
                else:
                    out.append(kernels.fake_quant_values(v, bits, g, use_kernels=True, layout=layout))
            return out

        return kernel

    arms = {"reference": reference}
    if kernels.kernels_active(None):
        for layout in layouts or [None]:
            arms[_arm_name(layouts, layout) if layouts else "kernel"] = kernel_arm(layout)
    return arms


def _kernel_bytes(kind, b, h, s, d, itemsize, g):
    """Fewest bytes one launch must move: x read, x_hat written, float32 scale and zero written."""
    data = 2 * b * h * s * d * itemsize
    keys = data + 8 * b * h * -(-s // g) * d
    values = data + 8 * b * h * s * -(-d // g)
    return {"keys": keys, "values": values, "flush": keys + values, "cache_flush": 2 * data}[kind]


def _compare(row, per_flush, arm, nbytes, copy_bps):
    """Speedup of one kernel arm over the reference, against the larger of their two A/A floors."""
    floor = max(row["noise_floor"]["reference"], row["noise_floor"][arm])
    cmp = harness.compare(per_flush["reference"], per_flush[arm], floor)
    bps = nbytes / row["arms"][arm]["median"]
    out = {
        "speedup": cmp["speedup"],
        "verdict": cmp["text"],
        "kernel_bytes": nbytes,
        "kernel_bytes_per_s": bps,
        "fraction_of_copy_bandwidth": bps / copy_bps if copy_bps else None,
    }
    if row["S"] in M4_RATIOS:
        out["m4_speedup"] = M4_RATIOS[row["S"]]
        out["beats_m4"] = cmp["speedup"] > M4_RATIOS[row["S"]] * (1 + floor)
    return out


def _row(s, kind, mode, per_step, times, arms, nbytes, copy_bps, layouts=None):
    """Per-flush figures from per-step samples (a step does ``per_step`` flushes)."""
    per_flush = {name: [t / per_step for t in ts] for name, ts in times.items()}
    row = {
        "S": s,
        "kind": kind,
        "mode": mode,
        "flushes_per_step": per_step,
        "arms": {name: harness.summarize(t) for name, t in per_flush.items()},
        "noise_floor": {name: harness.noise_floor(times[name], times[name + harness.AA_SUFFIX]) for name in arms},
    }
    if "kernel" in arms:
        row.update(_compare(row, per_flush, "kernel", nbytes, copy_bps))
        if layouts:
            row["kernel_layout"] = layouts[0]
            row["layouts"] = {
                lay: _compare(row, per_flush, _arm_name(layouts, lay), nbytes, copy_bps) for lay in layouts
            }
    return row


def _build_times(arms, n, per_step, repeats):
    """Per flush, the host time to build a step's graph (the Python calls up to MLX's lazy arrays,
    no evaluation): the part of the per-flush time that is not device work or MLX's own
    encoding. Built steps are evaluated outside the timed region so nothing piles up."""
    out = {}
    for name, fn in arms.items():
        samples = []
        for r in range(repeats):
            t = time.perf_counter()
            built = fn(r % n)
            samples.append((time.perf_counter() - t) / per_step)
            mx.eval(built)
        out[name] = harness.summarize(samples)
    return out


def measure(s, args, copy_bps):
    """Rows for one S: each kind timed one flush per step ("isolated": the whole eval + sync of a
    single flush) and ``--layers`` flushes per step ("in_graph": one flush per layer in one graph,
    as a decode step of the cache runs them; per-flush figures are step times / layers)."""
    dtype = getattr(mx, args.dtype)
    shape = (1, args.heads, s, args.head_dim)
    n = max(args.inputs, args.layers)
    keys = mx.random.split(mx.random.key(s), 2 * n)
    pool = {
        "keys": [mx.random.normal(shape, key=keys[j]).astype(dtype) for j in range(n)],
        "values": [mx.random.normal(shape, key=keys[n + j]).astype(dtype) for j in range(n)],
    }
    mx.eval(pool)
    rows = []
    modes = [("isolated", 1, args.repeats)]
    if args.layers > 1:
        modes.append(("in_graph", args.layers, max(args.repeats // 2, 5)))
    for kind in KINDS:
        nbytes = _kernel_bytes(kind, *shape, dtype.size, args.group_size)
        for mode, per_step, repeats in modes:
            arms = _arms(kind, pool, args.bits, args.group_size, per_step, args.layouts)
            exact, exact_by = None, {}
            if "kernel" in arms and mode == "isolated":  # same outputs before anything is timed
                want = arms["reference"](0)
                for name in arms:
                    if name != "reference":
                        got = arms[name](0)
                        got_, want_ = tree_flatten(got), tree_flatten(want)
                        exact_by[name] = len(got_) == len(want_) and all(
                            mx.array_equal(x, y).item() for (_, x), (_, y) in zip(got_, want_)
                        )
                exact = exact_by["kernel"]
            timed = dict(arms)
            for name in arms:
                timed[name + harness.AA_SUFFIX] = arms[name]
            times = harness.run_interleaved(timed, n, repeats, args.warmup)
            row = _row(s, kind, mode, per_step, times, arms, nbytes, copy_bps, args.layouts)
            if mode == "in_graph":
                row["build"] = _build_times(arms, n, per_step, max(repeats // 2, 3))
            if exact is not None:
                row["outputs_equal"] = exact
                for lay in row.get("layouts", {}):
                    row["layouts"][lay]["outputs_equal"] = exact_by[_arm_name(args.layouts, lay)]
            rows.append(row)
    del pool
    mx.clear_cache()
    return rows


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="vqpipe bench-kivi", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--heads", type=int, default=8, help="KV heads H (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension D (default 128)")
    p.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--seq", type=_ints, default=[32, 2048], help="headline S values (default 32,2048)")
    p.add_argument("--sweep", type=_ints, default=[64, 128, 256, 512, 1024, 4096, 8192, 16384, 32768])
    p.add_argument("--inputs", type=int, default=20, help="distinct inputs in the rotating pool (>= 20)")
    p.add_argument("--layers", type=int, default=32, help="flushes per step in the in-graph mode (1: off)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--copy-mib", type=int, default=1024, help="buffer for the copy-bandwidth measurement")
    p.add_argument(
        "--layouts",
        nargs="+",
        choices=kernels.LAYOUTS,
        default=None,
        help="time these kernel layouts side by side, e.g. --layouts vec warp (default: only the current one)",
    )
    p.add_argument("--quick", action="store_true", help="small run for CPU/CI: S=32,256, 4 inputs, 5 repeats, 4 layers")
    args = p.parse_args(argv)
    if args.layouts:
        args.layouts = list(dict.fromkeys(args.layouts))
    if args.quick:
        args.seq, args.sweep, args.inputs, args.repeats, args.warmup, args.copy_mib = [32, 256], [], 4, 5, 1, 64
        args.layers = 4
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    copy = roofline.measure_copy_bandwidth(args.copy_mib << 20, repeats=max(args.repeats // 5, 3), warmup=2)
    sizes = sorted(set(args.seq) | set(args.sweep))
    rows = []
    for s in sizes:
        new = measure(s, args, copy["median"])
        rows += new
        for mode in dict.fromkeys(r["mode"] for r in new):
            print(_line([r for r in new if r["mode"] == mode]), flush=True)
    result = {
        "environment": env.environment_or_error(),
        "backend": kernels.backend() if kernels.kernels_active(None) else None,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "copy_bandwidth": copy,
        "harness_overhead_s": harness.empty_call_overhead(args.repeats, args.warmup),
        "m4_speedups": {str(k): v for k, v in M4_RATIOS.items()},
        "results": rows,
    }
    record.write(args.out, "bench-kivi", result)  # stage, kind and the envelope: vqpipe/store/record.py
    print(f"bench-kivi: wrote {args.out}")
    return 0


def _line(rows):
    parts = []
    for r in rows:
        ref = r["arms"]["reference"]["median"] * 1e6
        if "layouts" in r:
            lays = ", ".join(
                f"{lay} {r['arms']['kernel' if lay == r['kernel_layout'] else 'kernel:' + lay]['median'] * 1e6:.1f} us "
                f"{c['speedup']:.2f}x {c['kernel_bytes_per_s'] / 1e9:.0f} GB/s"
                for lay, c in r["layouts"].items()
            )
            parts.append(f"{r['kind']}: ref {ref:.1f} us, kernel {lays}")
        elif "speedup" in r:
            parts.append(
                f"{r['kind']}: ref {ref:.1f} us, kernel {r['arms']['kernel']['median'] * 1e6:.1f} us, "
                f"{r['speedup']:.2f}x, {r['kernel_bytes_per_s'] / 1e9:.0f} GB/s"
            )
        else:
            parts.append(f"{r['kind']}: ref {ref:.1f} us")
    return f"S={rows[0]['S']} {rows[0]['mode']}: " + "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
