"""Trellis layers at prefill sizes on the GPU: the compiled mat-vec (csrc/trellis.cu, one pass over
the codes per 8 rows of x) and the dense path with its weight written by the extension's decode
(``decode``: ext.trellis_decode, then one matmul; what prefill runs above ext.GPU_MAX_M) against the
dense path with the codes decoded by MLX ops (``dense``: vqpipe/kernels/dequant.py ``trellis_forward``
without the code's scale), per row count M, on the qwen2.5-0.5b layer shapes the loaders make (q|k|v
fused, o, gate|up fused, down).

For each shape and M, arms interleaved A B C A' per input (>= 20 distinct rotated inputs, bf16):
``kernel``, ``dense``, ``decode``, ``kernel-aa`` (the A/A floor). One timing is one evaluation of the arm over
all inputs (a graph of ``--inputs`` calls) divided by their number, microseconds; the summary is
median [min-max] over reps and the median ratio kernel / dense. Peak memory per arm: one call
evaluated alone after ``mx.reset_peak_memory()``, the peak above what was active before (the
transient the call allocates: a dense weight and its decode intermediates, or nothing).
Deviation: max |kernel - dense| / max |dense| per shape and M (both float32-accumulated sums of
the same products in different orders).

    python -m experiments.trellis_prefill [--m 8 16 28 32 64 128 256] [--bits 4] [--inputs 20]
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from vqpipe.codec import trellis
from vqpipe.kernels import dequant, ext

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]


def layer(rng, out, n, bits):
    scales = mx.array((rng.random(out) + 0.5).astype(np.float32))
    words = rng.integers(0, 1 << 32, (out // 32, n // 8 * 8 * bits), dtype=np.uint64).astype(np.uint32)
    codes = mx.array(words)
    L = trellis.L_DEFAULT
    table = mx.array(np.asarray(trellis.table(L), np.float32))
    a, b = map(float, trellis.code_affine(L))
    mx.eval(scales, codes, table)
    return {
        "kernel": lambda x: ext.module().trellis_matvec(x, codes, scales, bits, L, a, b, None),
        "dense": lambda x: dequant.trellis_forward(x, codes, scales, table, bits, L),
        "decode": lambda x: dequant.trellis_forward(x, codes, scales, table, bits, L, None, trellis.SCALE),
    }


def time_batch(fn, xs):
    mx.synchronize()
    t = time.perf_counter()
    mx.eval([fn(x) for x in xs])
    mx.synchronize()
    return (time.perf_counter() - t) * 1e6 / len(xs)


def peak_of(fn, x):
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    y = fn(x)
    mx.eval(y)
    mx.synchronize()
    return mx.get_peak_memory() - before


def summary(v):
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[8, 16, 28, 32, 64, 128, 256])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--inputs", type=int, default=20)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out")
    args = p.parse_args()
    if ext.module() is None:
        raise SystemExit("trellis_prefill: needs vqpipe._ext (scripts/build_ext.sh; on a GPU host gpu.sh ext)")
    rng = np.random.default_rng(0)
    rows = []
    for out, n in SHAPES:
        arms = layer(rng, out, n, args.bits)
        for m in args.m:
            xs = [mx.array(rng.standard_normal((m, n)).astype(np.float32)).astype(mx.bfloat16)
                  for _ in range(args.inputs)]
            mx.eval(xs)
            for name in ("kernel", "dense", "decode"):  # warm-up: compiles, fills the allocator's cache
                time_batch(arms[name], xs[:2])
            t = {"kernel": [], "dense": [], "decode": [], "kernel-aa": []}
            for _ in range(args.reps):
                for name in ("kernel", "dense", "decode", "kernel-aa"):
                    t[name].append(time_batch(arms[name.replace("-aa", "")], xs))
            yk, yd = (arms[k](xs[0]).astype(mx.float32) for k in ("kernel", "dense"))
            dev = float(mx.max(mx.abs(yk - yd)) / mx.max(mx.abs(yd)))
            mx.clear_cache()
            same = bool(mx.array_equal(arms["decode"](xs[0]), arms["dense"](xs[0])).item())
            peak = {k: peak_of(arms[k], xs[0]) for k in ("kernel", "dense", "decode")}
            ratios = [a / b for a, b in zip(t["kernel"], t["dense"])]
            dratios = [a / b for a, b in zip(t["decode"], t["dense"])]
            aa = [a / b for a, b in zip(t["kernel-aa"], t["kernel"])]
            row = {"shape": [out, n], "m": m, "bits": args.bits, "us": {k: summary(v) for k, v in t.items()},
                   "kernel_over_dense": summary(ratios), "decode_over_dense": summary(dratios), "aa": summary(aa),
                   "peak_bytes": peak, "deviation": dev, "decode_equals_dense": same}
            rows.append(row)
            print(f"{out}x{n} M={m:4d}: kernel {statistics.median(t['kernel']):8.1f} us  dense "
                  f"{statistics.median(t['dense']):8.1f} us  ratio {statistics.median(ratios):.2f} "
                  f"[{min(ratios):.2f}-{max(ratios):.2f}] decode {statistics.median(t['decode']):8.1f} us ratio "
                  f"{statistics.median(dratios):.2f} [{min(dratios):.2f}-{max(dratios):.2f}] A/A "
                  f"{statistics.median(aa):.2f}  peak MB kernel {peak['kernel'] / 1e6:.1f} dense "
                  f"{peak['dense'] / 1e6:.1f} decode {peak['decode'] / 1e6:.1f}  dev {dev:.1e} same {same}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "device": str(mx.default_device())}, f, indent=1)


if __name__ == "__main__":
    main()
