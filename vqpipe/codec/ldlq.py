"""Block LDLQ with trellis codes (issue 34; experiments/vq/ldlq.py is where it was measured).

GPTQ's error feedback (vqpipe/codec/gptq.py) a block of g = trellis.GROUP rotated columns at a
time. gptq.ldl_factor gives H_r + damp = (I + N) D (I + N)^T with I + N unit upper. With B the
block diagonal of I + N, H = M (B D B^T) M^T and M = (I + N) B^-1 is unit block upper, so block b
is quantized from W_b + sum_{j<b} E_j M_jb (E = W - W_hat): the output error left is what later
blocks cannot absorb, the block's own coupling left to the Viterbi's plain squared error (as
QuIP# and QTIP do).

Scales as the scalar path's: one step per row, the RMS of the rotated row; after the codes, the
row scale is refit by H-weighted least squares (gptq.refit_steps, on the same damped H).
"""

import numpy as np

from . import gptq, trellis

LAZY = 128  # columns per lazy batch: a batch's errors reach the columns after it in one product


def block_feedback(n, g=trellis.GROUP):
    """M = (I + N) B^-1 with its diagonal blocks zeroed (float32 [d, d]), ``n`` from gptq.ldl_factor."""
    d = n.shape[0]
    a = n.astype(np.float64) + np.eye(d)
    m = np.empty((d, d), dtype=np.float64)
    for b0 in range(0, d, g):
        b1 = min(b0 + g, d)
        m[:, b0:b1] = a[:, b0:b1] @ np.linalg.inv(a[b0:b1, b0:b1])
        m[b0:b1, b0:b1] = 0
    return m.astype(np.float32)


def ldlq(w, bits, h=None, m=None, L=trellis.L_DEFAULT, tab=None):
    """Trellis codes of rotated rows ``w`` [rows, d] (rows a multiple of 32, d of 8) at ``bits``.

    ``h``: the damped rotated moments (as vqpipe/layers/qlinear.py's _rotated_factors gives them),
    ``m``: their :func:`block_feedback`; both None: no feedback, each block's tiles by plain
    Viterbi. Returns (packed uint32 [rows / 32, d / 8 * 8 bits] (trellis.py's layout), scales
    float32 [rows], code values float32 [rows, d])."""
    w = np.asarray(w, dtype=np.float32)
    rows, d = w.shape
    trellis.check_shape(rows, d)
    tab = trellis.table(L) if tab is None else tab
    g = trellis.GROUP
    step = np.maximum(np.sqrt(np.mean(w * w, axis=1)), 1e-30)[:, None]
    c = np.empty_like(w)
    codes = []
    target = w.copy() if m is not None else w
    for s0 in range(0, d, LAZY):
        s1 = min(s0 + LAZY, d)
        for b0 in range(s0, s1, g):
            b1 = b0 + g
            packed, c[:, b0:b1] = trellis.quantize(target[:, b0:b1] / step, bits, L, tab)
            codes.append(packed)
            if m is not None and b1 < s1:
                target[:, b1:s1] += (w[:, b0:b1] - step * c[:, b0:b1]) @ m[b0:b1, b1:s1]
        if m is not None and s1 < d:
            target[:, s1:] += (w[:, s0:s1] - step * c[:, s0:s1]) @ m[s0:s1, s1:]
    scales = gptq.refit_steps(w, c, None, h)[:, 0]
    return np.concatenate(codes, axis=1), scales.astype(np.float32), c
