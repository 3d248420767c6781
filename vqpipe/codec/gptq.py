"""GPTQ/LDLQ error feedback on the rotated Lloyd-Max grid, and per-group scales.

A linear layer's output error on inputs X is ||(W - W_hat) X||^2 = tr(E H E^T) with H = X X^T
(in x in, summed over calibration tokens). In the rotated basis (y = W R^T . R x) the weight is
W_r = W R^T and the input moments are H_r = R H R^T. GPTQ (Frantar et al., 2022; LDLQ in QuIP,
Chee et al., 2023, is the same recursion) quantizes W_r one column at a time and feeds each
column's error forward to the columns not yet quantized (through the Cholesky factor of H_r, in
LDL form: see _gptq_rows), so that the error left is what the remaining columns cannot absorb.
QuIP# and HIGGS run it on a Hadamard-rotated weight with a Gaussian grid, which is what we have.

Scales: the codebook is the Lloyd-Max grid of a unit variance entry (fixed per bits and width).
A group of ``group_size`` consecutive rotated entries of a row gets its own step, set from the
RMS of the group as it stands when GPTQ reaches it (after the feedback from earlier columns),
rounded to float16 before use (that is what is stored). When ``group_size`` is None a row has
one step, its RMS. After the codes are chosen the steps are refit by least squares, weighted by H
when there is one: with the codes fixed the H-weighted error is a quadratic in the steps.

All work is float32 numpy on the CPU, except the Cholesky factorisation (MLX on the CPU stream:
LAPACK through the OpenBLAS preload is several times faster than numpy's bundled build here).
"""

import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .codebook import boundaries

DAMP = 0.01  # diagonal damping, as a fraction of H's mean diagonal (GPTQ's default)
BLOCK = 128  # columns per lazy-batch block
INNER = 16  # columns per sub-block within a block (see _gptq_rows)
REFIT_ROWS = 256  # rows per chunk of the H-weighted scale refit (see refit_steps)
ROWS = 8192  # rows per GPTQ chunk: a block of them (4 MB) stays in cache (2048: 11.4 CPU-s for a 151,936-row head, 8192: 8.5, all rows at once: 17.3)


class Rotated(NamedTuple):
    """Input moments already in ``rotation``'s basis, R X^T X R^T (calibrate.collect sums them
    from the rotated activations)."""

    h: object  # [d, d] float32, numpy or mx
    rotation: object  # vqpipe.codec.rotation.Rotation


def rotate_hessian(h, rotation):
    """R H R^T for a symmetric H (mx array, in x in), or a Rotated H's own array when it is in
    ``rotation``'s basis (anything else is an error: the moments would not match the weights)."""
    if isinstance(h, Rotated):
        have, want = (h.rotation.kind, h.rotation.dim, h.rotation.seed), (rotation.kind, rotation.dim, rotation.seed)
        if have != want:
            raise ValueError(f"moments rotated by {have} cannot calibrate a layer rotated by {want}")
        return h.h
    return rotation.apply(rotation.apply(h.astype(mx.float32)).T)


def ldl_factor(h, damp=DAMP):
    """Strictly upper N with (H + damp * mean(diag H) I) = (I + N) D (I + N)^T, D diagonal (numpy
    float32): the error feedback of GPTQ in LDL form (below, and docs/gptq.md).

    Dead inputs (zero diagonal) get a unit diagonal; their weights are multiplied by zero anyway.
    If the damped H is still not positive definite in float32, the damping grows tenfold.
    """
    a = np.asarray(h, dtype=np.float32)
    d = a.shape[0]
    diag = a.diagonal().copy()
    dead = diag <= 0
    mean = mx.mean(mx.array(np.where(dead, np.float32(0), diag))).item()
    mean = mean if mean > 0 else 1.0
    base = diag + dead.astype(np.float32)
    # With J the reversal, J A J = L L^T gives A = V V^T for the upper V = J L J, and
    # I + N = V diag(V)^-1: one Cholesky (d^3 / 3 flops) and no inverse. The inverse's upper
    # Cholesky factor U that GPTQ is usually written with is V^-1 (a triangular inverse, as
    # many flops again); see gptq() for why V itself is enough. J A J is made once, in a private
    # copy whose diagonal is damped in place (a dense damp * mean * I cost two d x d temporaries,
    # 95 MB each at d = 4864, for the same float32 sums); reversed reads are the slow passes here.
    rev = np.ascontiguousarray(a[::-1, ::-1])
    for _ in range(4):
        np.fill_diagonal(rev, (base + np.float32(damp * mean))[::-1])
        low = mx.linalg.cholesky(mx.array(rev), stream=mx.cpu)
        mx.eval(low)  # the GIL is released while MLX computes (other threads run; vqpipe/parallel.py)
        low = np.asarray(low)  # MLX's buffer, no copy
        pivots = low.diagonal()[::-1].copy()
        # MLX leaves L's upper triangle zero, so J L J / pivots is already strictly upper but for
        # its unit diagonal: the same float32 quotients as triu(V, 1) / pivots, in one pass.
        if np.all(pivots > 0):
            n = np.divide(low[::-1, ::-1], pivots[None, :], out=np.empty((d, d), dtype=np.float32))
            np.fill_diagonal(n, 0)
            if np.isfinite(n).all():
                return n
        damp *= 10
    raise ValueError(f"calibration second moments (dim {d}) are not positive definite even with damping {damp / 10:g}")


def _f16(x):
    """Round to float16 (what grouped scales are stored as), kept away from zero and overflow."""
    return np.clip(x, 6.2e-5, 65504).astype(np.float16).astype(np.float32)


def gptq(w, n, levels, group_size=None, block=BLOCK, rows=ROWS):
    """Quantize rotated weights ``w`` [out, d] with error feedback through ``n`` (ldl_factor).

    ``levels`` are the unit-variance codebook levels (sorted). Returns (indices uint8 [out, d],
    steps float32 [out, groups]); the dequantized entry is steps[o, g] * levels[idx[o, i]].
    ``n`` None gives plain round-to-nearest with the same scales.
    """
    out, d = w.shape
    root = math.sqrt(d)
    gs = group_size or d
    if d % gs:
        raise ValueError(f"group size {gs} does not divide the row length {d}")
    w = np.asarray(w, dtype=np.float32)
    if not (np.isfinite(w.min()) and np.isfinite(w.max())):  # NaN propagates; no weight-sized temporary
        raise ValueError("GPTQ got a weight with non-finite entries")
    n = None if n is None else np.asarray(n, dtype=np.float32)
    bounds = boundaries(np.asarray(levels)).astype(np.float32)
    levels = np.asarray(levels, dtype=np.float32)
    if gs < d:
        block = gs * max(1, block // gs)  # a group never straddles two blocks
    idx = np.empty((out, d), dtype=np.uint8)
    steps = np.empty((out, d // gs), dtype=np.float32)
    # Rows are independent: a chunk of them at a time keeps a block's working set in cache (one
    # 151,936-row head column is 600 kB). Every entry sees the same operations as with all rows at
    # once; the bytes can still depend on ``rows`` where the BLAS's product rounding depends on the
    # matrix width (OpenBLAS's Haswell kernels), so callers keep ``rows`` fixed.
    for r0, r1 in _chunks(out, rows):
        i, s = _gptq_rows(w[r0:r1], n, bounds, levels, gs, block, root)
        idx[r0:r1], steps[r0:r1] = i.T, s.T
    return idx, steps


def _gptq_rows(w, n, bounds, levels, gs, block, root):
    """GPTQ on a chunk of rows; (indices [d, rows], steps [groups, rows]), transposed.

    LDL form (LDLQ, Chee et al., 2023): with H = (I + N) D (I + N)^T, column k is quantized from
    w_k + sum_{j<k} (w_j - q_j) N[j, k], the total errors of the columns before it, where the
    usual form pushes each column's rounding error through rows of U = chol(H^-1) instead. The two
    are the same in exact arithmetic (I + N is U^-1 with its columns scaled to a unit diagonal),
    so this needs only H's own factor. Lazy batches as in GPTQ: the errors of a block of columns
    reach the columns after it in one matrix product."""
    out, d = w.shape
    table = _code_table(bounds)
    # Column i of W is row i here: every per-column operation touches contiguous memory.
    w0 = w.T
    wt = np.array(w0, order="C")
    idx = np.empty((d, out), dtype=np.uint8)
    steps = np.empty((d // gs, out), dtype=np.float32)
    step = None
    if gs == d:
        step = np.maximum(np.sqrt(np.mean(wt * wt, axis=0)), 1e-30)
        steps[0] = step
    # Two levels of lazy batches: within a block, a sub-block of ``inner`` columns at a time takes
    # its errors as rank-1 updates and passes them on to the rest of the block in one product (a
    # block's rank-1 updates alone were half of the loop's time). A group's step is set at a
    # sub-block start (inner divides the group size), when all of its columns are up to date.
    inner = INNER if gs == d else math.gcd(gs, INNER)
    for b0 in range(0, d, block):
        b1 = min(b0 + block, d)
        e1 = np.empty((b1 - b0, out), dtype=np.float32)
        for c0 in range(b0, b1, inner):
            c1 = min(c0 + inner, b1)
            for i in range(c0, c1):
                if gs < d and i % gs == 0:
                    g = wt[i : i + gs]
                    step = _f16(np.sqrt(np.mean(g * g, axis=0)) * root) / root
                    steps[i // gs] = step
                q = _codes(wt[i] / step, table)
                idx[i] = q
                if n is None:
                    continue
                err = w0[i] - step * levels[q]
                e1[i - b0] = err
                if i + 1 < c1:
                    wt[i + 1 : c1] += n[i, i + 1 : c1, None] * err
            if n is not None and c1 < b1:
                wt[c1:b1] += n[c0:c1, c1:b1].T @ e1[c0 - b0 : c1 - b0]
        if n is not None and b1 < d:
            wt[b1:] += n[b0:b1, b1:].T @ e1
    return idx, steps


def _code_table(bounds):
    """A lookup for _codes: cells of a quarter of the narrowest gap between two boundaries, each
    with the code of its centre; any t is then within one code of its cell's."""
    bounds = np.asarray(bounds, dtype=np.float32)
    width = float(np.min(np.diff(bounds))) / 4 if len(bounds) > 1 else 1.0
    cells = int(np.ceil((bounds[-1] - bounds[0]) / width)) + 2
    centres = bounds[0] + (np.arange(-1, cells) + 0.5) * width  # cell k + 1 holds [lo + k w, lo + (k + 1) w)
    # NaN past both ends: a comparison with it is false, so the first and last codes are never
    # corrected outwards (an infinite sentinel would move t = -inf below code 0)
    ext = np.concatenate([[np.nan], bounds, [np.nan]]).astype(np.float32)
    return (np.float32(1 / width), np.float32(1 - bounds[0] / width), cells,
            np.searchsorted(bounds, centres).astype(np.intp), ext[:-1].copy(), ext[1:].copy())


def _codes(t, table):
    """np.searchsorted(bounds, t) (the number of boundaries below each t, the nearest level's
    index), bit for bit, 2-4x faster: a guess g from t's cell is off by at most one (no cell
    edge, even rounded, is a quarter gap away from its centre), and g + [t > b_g] - [t <= b_{g-1}]
    corrects it. searchsorted's binary search was ~40 % of SmolLM2's GPTQ column loop."""
    inv, off, cells, guess, lower, upper = table
    y = t * inv
    y += off
    np.clip(y, 0, cells, out=y)
    g = guess[y.astype(np.intp)]
    q = g + (t > upper[g])
    q -= t <= lower[g]
    return q


def refit_steps(w, c, group_size=None, h=None, chunk=None):
    """Least-squares steps for fixed codes: minimise sum_o (w_o - w_hat_o) H (w_o - w_hat_o)^T
    (H = I when None) with w_hat_o[i] = s[o, g(i)] * c[o, i]. ``c`` holds the code values
    (levels[idx]). Returns s [out, groups] float32 (rows or groups whose codes are all zero keep 0).
    """
    out, d = w.shape
    gs = group_size or d
    groups = d // gs
    w = np.asarray(w, dtype=np.float32)
    c = np.asarray(c, dtype=np.float32)
    if h is None:  # block-diagonal: one scalar problem per group
        cw = (c * w).reshape(out, groups, gs).sum(-1, dtype=np.float64)
        cc = (c * c).reshape(out, groups, gs).sum(-1, dtype=np.float64)
        return (cw / np.maximum(cc, 1e-300)).astype(np.float32)
    h = np.asarray(h, dtype=np.float32)
    # A chunk of rows at a time (each row is its own problem): per group the product below is
    # [chunk, d], 1.2 M floats at 256 rows of a 4864-wide layer, which stays in cache for the two
    # reductions that read it (a 4864-wide down_proj: 0.80 CPU-s at 256 rows, 0.86 at 64, 0.96 at
    # all 896). The result does not depend on the chunk (tests/test_gptq.py).
    chunk = chunk or REFIT_ROWS
    s = np.empty((out, groups), dtype=np.float32)
    ht = [np.ascontiguousarray(h[g * gs : (g + 1) * gs]) for g in range(groups)]  # H rows of group g
    for r0, r1 in _chunks(out, chunk):
        s[r0:r1] = _refit_rows(w[r0:r1], c[r0:r1], h, ht, gs)
    return s


def _chunks(n, size):
    """[(start, stop)] covering range(n) in chunks of ``size``, a last chunk of one row joined to
    the one before: numpy and BLAS treat a single row differently (a [d, 1] column is summed
    pairwise, not in row order; a 1-row product is a GEMV), and the results would differ in the
    last bit from computing all rows at once."""
    starts = list(range(0, n, size))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    return list(zip(starts, starts[1:] + [n]))


def _refit_rows(w, c, h, ht, gs):
    n, d = w.shape
    groups = d // gs
    if groups == 1:  # one scale per row: <c, w H> = <c H, w> (H symmetric), one product for both
        y = c @ h
        b = np.einsum("ij,ij->i", y, w, dtype=np.float64)[:, None]
        cc = np.einsum("ij,ij->i", y, c, dtype=np.float64)[:, None]
        return (b / np.maximum(cc, 1e-300)).astype(np.float32)
    # Per group g: y = c_g H[g, :] (the codes of group g times H's rows of that group, [n, d]);
    # then A[n, g, g'] = <y, c> over group g' and b[n, g] = <y, w> over the whole row. One d x d
    # product per row in all, at K = group_size, and no [n, groups, d] temporary (materialising
    # it and reducing it as a batch of mat-vecs made the refit 2.5x slower).
    cg = c.reshape(n, groups, gs)
    a = np.empty((n, groups, groups), dtype=np.float64)
    b = np.empty((n, groups), dtype=np.float64)
    for g in range(groups):
        y = c[:, g * gs : (g + 1) * gs] @ ht[g]
        a[:, g] = np.einsum("ngk,ngk->ng", y.reshape(n, groups, gs), cg)
        b[:, g] = np.einsum("nk,nk->n", y, w)
    diag = np.einsum("ngg->ng", a)
    a += np.eye(groups)[None] * (1e-9 * np.maximum(diag.max(-1), 1e-300))[:, None, None]
    return np.linalg.solve(a, b[:, :, None])[..., 0]
