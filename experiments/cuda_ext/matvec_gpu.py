"""The extension's CUDA mat-vec (vqpipe._ext, csrc/matvec.cu) beside vqpipe's decode kernel
(vqpipe/kernels/qmv.py through ``mx.fast.cuda_kernel``) and the dense path, on one layer at a time: is it
right (against the dense float32 formula), and what does a call cost (K calls evaluated together,
arms interleaved, median [min-max] over rounds, µs per call, the input rotation included in both)?

    PYTHONPATH=$PWD python experiments/cuda_ext/matvec_gpu.py --out matvec_gpu.json
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

from vqpipe.kernels import ext
from vqpipe.layers.qlinear import QuantizedLinear, dense_forward

SHAPES = {"qwen q": (896, 896), "qwen up": (4864, 896), "qwen down": (896, 4864),
          "8B q": (4096, 4096), "8B up": (14336, 4096), "8B down": (4096, 14336)}


def layer(out_f, in_f, bits, seed):
    mx.random.seed(seed)
    lin = nn.Linear(in_f, out_f, bias=False)
    lin.weight = (mx.random.normal((out_f, in_f)) * 0.02).astype(mx.bfloat16)
    q = QuantizedLinear.from_linear(lin, bits, "auto", seed)
    mx.eval(q.parameters())
    return q


def arms(q, bits):
    def via_ext(x):
        return ext.matvec(q.rotation.apply(x), q.packed, q.scales, q.codebook, bits)

    return {"ext": via_ext, "qmv": q, "ext-aa": via_ext}


def timed(fns, xs, rounds):
    times = {k: [] for k in fns}
    for f in fns.values():
        mx.eval([f(x) for x in xs])
    for _ in range(rounds):
        for k, f in fns.items():
            mx.synchronize()
            t0 = time.perf_counter()
            mx.eval([f(x) for x in xs])
            mx.synchronize()
            times[k].append((time.perf_counter() - t0) / len(xs) * 1e6)
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)} for k, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out")
    a = p.parse_args(argv)
    assert ext.available() and ext.module().has_gpu(), "vqpipe._ext without its CUDA kernel"
    out = []
    for bits in a.bits:
        for name, (o, i) in SHAPES.items():
            q = layer(o, i, bits, 0)
            x = mx.random.normal((1, i)).astype(mx.bfloat16)
            ref = dense_forward(q.rotation.apply(x.astype(mx.float32)), q.packed, q.scales, q.codebook, bits)
            scale = mx.max(mx.abs(ref)).item()
            fns = arms(q, bits)
            err = {k: mx.max(mx.abs(f(x).astype(mx.float32) - ref)).item() / scale for k, f in fns.items() if k != "ext-aa"}
            xs = [mx.random.normal((1, i)).astype(mx.bfloat16) for _ in range(a.calls)]
            t = timed(fns, xs, a.rounds)
            row = {"layer": name, "shape": [o, i], "bits": bits, "rel_err": err, "us_per_call": t}
            out.append(row)
            print(f"{bits}b {name:10s} {o}x{i}: err ext {err['ext']:.1e} qmv {err['qmv']:.1e}; us/call "
                  + ", ".join(f"{k} {v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]" for k, v in t.items()),
                  flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
