"""Lloyd-Max scalar codebooks.

After a random rotation, the entries of a unit-norm row of length d are distributed like one
coordinate of a point uniform on the sphere S^(d-1). Scaled by sqrt(d), that coordinate has density
proportional to (1 - t^2/d)^((d-3)/2) on |t| < sqrt(d), which tends to the unit Gaussian as d grows.
The codebook for (bits, d) is the Lloyd-Max quantizer of that density, in the sqrt(d)-scaled units.
"""

from functools import lru_cache

import numpy as np

from . import trellis

BITS = (2, 3, 4)  # a model's base width (the pipeline's bits)
# a single layer's width: a mixed allocation gives sensitive layers more (vqpipe/codec/allocate.py)
LAYER_BITS = (2, 3, 4, 5, 6, 8)
_GRID = 1 << 19


def gaussian_pdf(t):
    return np.exp(-0.5 * t * t) / np.sqrt(2 * np.pi)


def sphere_pdf(dim):
    """Density of sqrt(dim) * u_1 for u uniform on the unit sphere in R^dim (unnormalised)."""
    if dim < 3:
        raise ValueError(f"sphere coordinate density needs dim >= 3, got {dim}")

    def pdf(t):
        inside = np.abs(t) < np.sqrt(dim)
        safe = np.where(inside, 1 - t * t / dim, 1.0)
        return np.where(inside, np.exp(0.5 * (dim - 3) * np.log(safe)), 0.0)

    return pdf


def lloyd_max(pdf, levels, support, tol=1e-12, max_iter=20000):
    """Fit ``levels`` reconstruction points to ``pdf`` on [-support, support].

    Works on a fine grid with cumulative moments, so one iteration costs O(levels), not O(grid).
    Returns (sorted levels, mean squared error) with the pdf normalised on the grid.
    """
    t = np.linspace(-support, support, _GRID)
    w = pdf(t)
    w = w / w.sum()
    c0 = np.concatenate([[0.0], np.cumsum(w)])
    c1 = np.concatenate([[0.0], np.cumsum(w * t)])
    c2 = np.concatenate([[0.0], np.cumsum(w * t * t)])
    # Start from the quantiles of the cell centres: well inside the support, all cells non-empty.
    x = np.interp((np.arange(levels) + 0.5) / levels, c0[1:], t)
    for _ in range(max_iter):
        edges = np.searchsorted(t, (x[1:] + x[:-1]) / 2)
        lo = np.concatenate([[0], edges])
        hi = np.concatenate([edges, [_GRID]])
        mass = c0[hi] - c0[lo]
        new = np.where(mass > 0, (c1[hi] - c1[lo]) / np.maximum(mass, 1e-300), x)
        done = np.max(np.abs(new - x)) < tol
        x = new
        if done:
            break
    edges = np.searchsorted(t, (x[1:] + x[:-1]) / 2)
    lo = np.concatenate([[0], edges])
    hi = np.concatenate([edges, [_GRID]])
    mse = np.sum((c2[hi] - c2[lo]) - 2 * x * (c1[hi] - c1[lo]) + x * x * (c0[hi] - c0[lo]))
    return x, float(mse)


def check_bits(bits, allowed=BITS):
    if bits not in allowed:
        raise ValueError(f"unsupported bits {bits!r}; choose one of {allowed}")


@lru_cache(maxsize=None)
def _fit(bits, dim):
    check_bits(bits, LAYER_BITS)
    if dim >= 3:
        levels, mse = lloyd_max(sphere_pdf(dim), 1 << bits, float(np.sqrt(dim)))
    else:
        levels, mse = lloyd_max(gaussian_pdf, 1 << bits, 10.0)
    levels.setflags(write=False)
    return levels, mse


def codebook(bits, dim):
    """Sorted Lloyd-Max levels (float64, sqrt(dim)-scaled units) for rotated rows of length dim."""
    return _fit(bits, dim)[0]


def distortion(bits, dim, kind="scalar"):
    """The codebook's mean squared error per entry of a rotated unit-variance row (its Lloyd-Max
    fit's): what one entry of a row with RMS s loses, in units of s^2 (vqpipe/quant/recipe.py).
    ``kind`` "trellis": the bitshift trellis's (vqpipe/codec/trellis.py), measured on Gaussian data."""
    if kind == "trellis":
        return trellis.distortion(bits)
    return _fit(bits, dim)[1]


def boundaries(levels):
    """Decision thresholds: a value t maps to ``searchsorted(boundaries, t)``."""
    return (levels[1:] + levels[:-1]) / 2
