"""Decode mat-vec of a trellis weight (vqpipe._ext.trellis_matvec: csrc/trellis.cpp on the CPU,
csrc/trellis.cu with ``--device gpu``) against the scalar codebook mat-vec at the same bits (on the
CPU vqpipe._ext.codebook_matvec, on the GPU the kernel a scalar layer takes there,
vqpipe/kernels/dispatch.py), on SmolLM2's layer shapes or others.

Arms, interleaved A B A' B' per input in one process, over >= 20 distinct rotated inputs x [m, in]
(Gaussian, through the layer width's seeded rotation, as a layer's call rotates them):
- ``scalar``: the codebook mat-vec, per-row scales, random codes (A);
- ``trellis``: the trellis mat-vec, L = 10, random codes (B), the same per-row scales;
- ``scalar-aa``: the scalar arm again: the A/A noise floor.
Each timing is one call's wall time (building the MLX op and evaluating it), microseconds:
median [min-max] over inputs x reps, and the median ratio trellis / scalar. On the GPU one timing
is one evaluation of the arm over all inputs at once (a graph of ``--inputs`` calls) divided by
their number: the kernels' time with the launches' host cost spread, not one call's latency.

    python -m experiments.bench_trellis_matvec [--bits 2] [--m 1] [--inputs 24] [--reps 5]
"""

import argparse
import json
import os
import statistics
import time

import mlx.core as mx
import numpy as np

from vqpipe.codec import rotation, trellis
from vqpipe.codec.bitpack import pack
from vqpipe.codec.codebook import codebook
from vqpipe.kernels import dispatch, ext

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]


def layers(rng, out, n, bits, gpu=False):
    scales = mx.array((rng.random(out) + 0.5).astype(np.float32))
    idx = rng.integers(0, 1 << bits, (out, n)).astype(np.uint8)
    scalar = (mx.array(pack(idx, bits)), scales, mx.array(np.asarray(codebook(bits, n), np.float32)))
    words = rng.integers(0, 1 << 32, (out // 32, n // 8 * 8 * bits), dtype=np.uint64).astype(np.uint32)
    a, b = map(float, trellis.code_affine())
    codes = mx.array(words)
    mx.eval(*scalar, codes)
    if gpu:
        def scalar_fn(x):
            return dispatch.launch("cuda", x, scalar[0], scalar[1], scalar[2], bits)
    else:
        def scalar_fn(x):
            return ext.matvec(x, *scalar, bits)
    return {
        "scalar": scalar_fn,
        "trellis": lambda x: ext.module().trellis_matvec(x, codes, scales, bits, trellis.L_DEFAULT, a, b),
        "scalar-aa": scalar_fn,
    }


def time_call(fn, x):
    t = time.perf_counter()
    mx.eval(fn(x))
    return (time.perf_counter() - t) * 1e6


def time_batch(fn, xs):
    mx.synchronize()
    t = time.perf_counter()
    mx.eval([fn(x) for x in xs])
    return (time.perf_counter() - t) * 1e6 / len(xs)


def summary(v):
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--inputs", type=int, default=24)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--shapes", nargs="+", help="OUTxIN (default: SmolLM2's four)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--out")
    args = p.parse_args()
    gpu = args.device == "gpu"
    mx.set_default_device(mx.gpu if gpu else mx.cpu)
    rng = np.random.default_rng(0)
    report = {"load_start": os.getloadavg(), "threads": ext.module().threads(), "avx2": ext.module().has_avx2(),
              "bits": args.bits, "m": args.m, "device": args.device, "shapes": {}}
    print(f"load {report['load_start']}, pool threads {report['threads']}, AVX2 {report['avx2']}, "
          f"bits {args.bits}, m {args.m}")
    shapes = [tuple(map(int, v.split("x"))) for v in args.shapes] if args.shapes else SHAPES
    for out, n in shapes:
        fns = layers(rng, out, n, args.bits, gpu)
        rot = rotation.make_rotation("auto", n, seed=1)
        xs = [rot.apply(mx.array(rng.standard_normal((args.m, n)).astype(np.float32))) for _ in range(args.inputs)]
        mx.eval(*xs)
        for fn in fns.values():  # warm up
            for x in xs[:3]:
                time_call(fn, x)
        times = {name: [] for name in fns}
        for _ in range(args.reps):
            if gpu:
                for name, fn in fns.items():
                    times[name].append(time_batch(fn, xs))
                continue
            for x in xs:
                for name, fn in fns.items():
                    times[name].append(time_call(fn, x))
        ratio = [b / a for a, b in zip(times["scalar"], times["trellis"])]
        aa = [b / a for a, b in zip(times["scalar"], times["scalar-aa"])]
        row = {name: summary(t) for name, t in times.items()}
        row["trellis/scalar"] = summary(ratio)
        row["A/A"] = summary(aa)
        report["shapes"][f"{out}x{n}"] = row
        cells = "  ".join(f"{name} {s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]" for name, s in row.items()
                          if name in times)
        print(f"{out:6d} x {n:5d}: {cells} us; trellis/scalar {row['trellis/scalar']['median']:.2f}x "
              f"(A/A {row['A/A']['median']:.2f}x, n = {len(ratio)})")
    report["load_end"] = os.getloadavg()
    print(f"load {report['load_end']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
