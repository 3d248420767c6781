"""Block LDLQ (GPTQ's error feedback, a block of columns at a time) in vqpipe's rotated basis,
with any quantizer of experiments/vq/codes.py.

vqpipe.gptq.ldl_factor gives H_r + damp = (I + N) D (I + N)^T with I + N unit upper. For blocks
of g columns, with B the block diagonal of I + N, H = M (B D B^T) M^T and M = (I + N) B^-1 is unit
block upper: the output error is sum_b R_b D'_b R_b^T with R_b = E_b + sum_{j<b} E_j M_jb. So
block b is quantized from W_b + sum_{j<b} E_j M_jb (E = W - W_hat), the block's own coupling D'_b
left to the quantizer's plain MSE (as QuIP# does). g = 1 is vqpipe's scalar GPTQ.

Scales as vqpipe's: one step per row, the RMS of the rotated row before feedback; after the codes
are chosen the row scale is refit by H-weighted least squares (vqpipe.gptq.refit_steps, on the
same damped H). One float32 per row is stored, as the scalar arm stores.
"""

import numpy as np

from vqpipe.codec import gptq

LAZY = 128  # columns per lazy batch


def block_feedback(n, g):
    """M = (I + N) B^-1 with its diagonal blocks zeroed (float32 [d, d])."""
    d = n.shape[0]
    a = n.astype(np.float64) + np.eye(d)
    m = np.empty((d, d), dtype=np.float64)
    for b0 in range(0, d, g):
        b1 = min(b0 + g, d)
        inv = np.linalg.inv(a[b0:b1, b0:b1])
        m[:, b0:b1] = a[:, b0:b1] @ inv
        m[b0:b1, b0:b1] = 0
    return m.astype(np.float32)


def ldlq(w, h, quantizer, damp=gptq.DAMP):
    """Quantize rotated rows w [rows, d] with moments h (rotated, [d, d]; None: no feedback).

    Returns (code values c [rows, d] in unit-variance units, refit scales s [rows], output error
    tr(E H E^T) / tr(W H W^T) on the calibration moments (or the weight MSE ratio without h))."""
    w = np.asarray(w, dtype=np.float32)
    rows, d = w.shape
    g = quantizer.group
    if h is not None:
        h = np.array(h, dtype=np.float32)
        n = gptq.ldl_factor(h, damp)
        np.fill_diagonal(h, h.diagonal() + np.float32(damp * max(float(np.mean(np.diag(h))), 1e-30)))
        m = block_feedback(n, g)
    step = np.maximum(np.sqrt(np.mean(w * w, axis=1)), 1e-30)[:, None]
    c = np.empty_like(w)
    target = w.copy()
    state = quantizer.start(rows)
    # lazy batches (GPTQ's): a block's error reaches the rest of its super-block at once, and the
    # super-block's errors reach the columns after it in one product
    sb = max(g, (LAZY // g) * g)
    for s0 in range(0, d, sb):
        s1 = min(s0 + sb, d)
        for b0 in range(s0, s1, g):
            b1 = min(b0 + g, s1)
            c[:, b0:b1], state = quantizer.quantize(target[:, b0:b1] / step, state)
            if h is not None and b1 < s1:
                e = w[:, b0:b1] - step * c[:, b0:b1]
                target[:, b1:s1] += e @ m[b0:b1, b1:s1]
        if h is not None and s1 < d:
            e = w[:, s0:s1] - step * c[:, s0:s1]
            target[:, s1:] += e @ m[s0:s1, s1:]
    if h is None:
        s = gptq.refit_steps(w, c)[:, 0]
        e = w - s[:, None] * c
        return c, s, float((e * e).sum() / (w * w).sum())
    s = gptq.refit_steps(w, c, None, h)[:, 0]
    e = w - s[:, None] * c
    err = float(np.einsum("ij,ij->", e @ h, e, dtype=np.float64) / np.einsum("ij,ij->", w @ h, w, dtype=np.float64))
    return c, s, err
