"""Viterbi throughput of the bitshift trellis (vqpipe.codec.trellis, L = 10): the compiled kernel
(vqpipe._ext.trellis_viterbi) on 1 and 2 threads against the experiment's plain C
(experiments/vq/viterbi.c, the same threads), arms interleaved A B A B in one process.

    python -m experiments.bench_trellis_viterbi [--tiles 512] [--reps 5] [--k 2 3 4 5]

Prints weights/s (median [min-max] over reps) and the implied Viterbi time of SmolLM2
(134.5 M weights) and qwen2.5-0.5b (494 M weights).
"""

import argparse
import os
import statistics
import time

import numpy as np

from experiments.vq import codes
from vqpipe import _ext
from vqpipe.codec import trellis

MODELS = {"smollm2": 134.5e6, "qwen2.5-0.5b": 494e6}


def arms(threads):
    out = {}
    for th in threads:
        out[f"ext/{th}"] = lambda x, tab, k, th=th: _ext.trellis_viterbi(x, tab, k, th)
        out[f"viterbi.c/{th}"] = lambda x, tab, k, th=th: codes.viterbi(x, trellis.L_DEFAULT, k, tab, th)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiles", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    tab = trellis.table()
    rng = np.random.default_rng(0)
    print(f"load {os.getloadavg()}; pool threads {_ext.threads()}, AVX2 {_ext.has_avx2()}")
    for k in args.k:
        x = rng.standard_normal((args.tiles, trellis.TILE_ROWS * trellis.GROUP)).astype(np.float32)
        fns = arms(args.threads)
        ref = trellis._viterbi_numpy(x[:8], trellis.L_DEFAULT, k, tab)
        times = {name: [] for name in fns}
        for name, f in fns.items():  # warm up, and every arm gives the reference's states
            assert np.array_equal(np.asarray(f(x[:8], tab, k)), ref), name
        for _ in range(args.reps):
            for name, f in fns.items():
                t = time.perf_counter()
                f(x, tab, k)
                times[name].append(time.perf_counter() - t)
        for name, ts in times.items():
            rate = x.size / np.array(ts)
            med = statistics.median(rate)
            proj = ", ".join(f"{m} {n / med:.0f} s" for m, n in MODELS.items())
            ns = 1e9 / (med * (1 << trellis.L_DEFAULT))
            print(f"k={k} {name:12s} {med / 1e6:7.2f} M weights/s [{rate.min() / 1e6:.2f}-{rate.max() / 1e6:.2f}]"
                  f" ({ns:.3f} ns per state-step) -> {proj}")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
