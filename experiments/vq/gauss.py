"""Mean squared error of each quantizer on i.i.d. N(0, 1) data, against the rate-distortion bound
D(R) = 2^(-2R) of a unit Gaussian (0.0625 at 2 bits, 0.015625 at 3).

``python -m experiments.vq.gauss`` prints a table; ``--fit`` also grid-searches each vector
quantizer's scale (the only tuned constant, fitted here on synthetic data, never on model text).
Rows are quantized block by block as the model quantizer does (a trellis carries its state across
blocks), each row with its least-squares scale refit (as vqpipe's rows) and without (the codebook alone).
"""

import argparse
import json
import time

import numpy as np

from experiments.vq.codes import E8P, Scalar, Trellis


def run(q, x):
    """(MSE at the codebook's own scale, MSE after a least-squares scale per row, seconds)."""
    rows, d = x.shape
    g = q.group
    state = q.start(rows)
    c = np.empty_like(x)
    t0 = time.perf_counter()
    for b0 in range(0, d, g):
        c[:, b0:b0 + g], state = q.quantize(x[:, b0:b0 + g], state)
    sec = time.perf_counter() - t0
    raw = float(np.mean((x - c) ** 2))
    s = (x * c).sum(1) / np.maximum((c * c).sum(1), 1e-30)
    fit = float(np.mean((x - s[:, None] * c) ** 2))
    return raw, fit, sec


def fit_scale(make, x, grid):
    best = min(grid, key=lambda s: run(make(s), x)[0])
    return best


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    x = rng.standard_normal((a.rows, a.dim)).astype(np.float32)
    xfit = np.random.default_rng(a.seed + 100).standard_normal((64, a.dim)).astype(np.float32)
    sc = {8: 1.08, 10: 1.05}  # experiments/vq/smollm2.py SCALES (fitted with --fit, 64 rows, seed 101)
    arms = [("scalar 2b", lambda s: Scalar(2, a.dim)), ("scalar 3b", lambda s: Scalar(3, a.dim))]
    arms += [("e8p 2b", lambda s: E8P(s or 1.03)), ("e8p 2b full search", lambda s: E8P(s or 1.03, top=256))]
    for L in (6, 8, 10, 12):
        for code in ("1mad", "3inst"):
            arms.append((f"trellis L{L} {code} 2b", lambda s, L=L, code=code: Trellis(L, 2, code, s or sc.get(L, 1.0))))
    for L in (8, 10):
        arms.append((f"trellis L{L} 1mad 3b", lambda s, L=L: Trellis(L, 3, "1mad", s or 1.0)))
    rows = []
    for name, make in arms:
        scale = None
        if a.fit and not name.startswith("scalar"):
            grid = np.round(np.arange(0.80, 1.25, 0.02), 3) if name.startswith("e8p") else np.round(np.arange(0.70, 1.15, 0.02), 3)
            scale = float(fit_scale(make, xfit, grid))
        q = make(scale)
        raw, fit, sec = run(q, x)
        bits = q.bits
        rows.append({"arm": name, "bits": bits, "scale": scale, "mse": raw, "mse_row_refit": fit,
                     "bound": 2.0 ** (-2 * bits), "seconds_per_Mweight": sec / x.size * 1e6})
        print(f"{name:26s} scale {scale}  MSE {raw:.5f}  (row refit {fit:.5f})  bound {2.0 ** (-2 * bits):.5f}  "
              f"{sec / x.size * 1e6:.2f} s/Mweight", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": a.rows, "dim": a.dim, "seed": a.seed, "arms": rows}, f, indent=1)


if __name__ == "__main__":
    main()
