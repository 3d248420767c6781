"""A trained table for the bitshift trellis (QTIP's tuned-LUT idea): start from the 1MAD code and
alternate Viterbi (the best path of each training sequence) and centroids (each state's value the
mean of the samples its path visits), on synthetic N(0, 1) sequences only, never on model weights.

    python -m experiments.vq.train_lut --L 10 --bits 2 --out experiments/vq/lut_L10_b2.npy
"""

import argparse
import time

import numpy as np

from experiments.vq.codes import trellis_table, viterbi


def train(L, bits, iters=12, n=2048, T=256, seed=3, scale=1.0, progress=print):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, T)).astype(np.float32)
    tab = (trellis_table(L, "1mad") * np.float32(scale)).astype(np.float32)
    for it in range(iters):
        st = viterbi(x, L, bits, tab)
        mse = float(np.mean((x - tab[st]) ** 2))
        cnt = np.bincount(st.ravel(), minlength=1 << L)
        tot = np.bincount(st.ravel(), weights=x.ravel(), minlength=1 << L)
        tab = np.where(cnt > 0, tot / np.maximum(cnt, 1), tab).astype(np.float32)
        progress(f"iter {it}: train MSE {mse:.5f}")
    return tab


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=10)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    tab = train(a.L, a.bits, a.iters)
    np.save(a.out, tab)
    test = np.random.default_rng(99).standard_normal((512, 256)).astype(np.float32)
    for name, t in (("1mad", trellis_table(a.L, "1mad")), ("trained", tab)):
        st = viterbi(test, a.L, a.bits, t)
        print(f"{name}: held-out MSE {np.mean((test - t[st]) ** 2):.5f}")
    print(f"{time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
