"""Reference KIVI quantizer in plain MLX ops: the specification the fused kernels must match bit for bit.

Asymmetric min/max over groups of ``G`` elements, all arithmetic in float32 whatever the input dtype:

    zero  = min(g)
    scale = (max(g) - min(g)) / (2**bits - 1)          # one IEEE division
    q     = clip(rint((x - zero) / safe), 0, 2**bits - 1)   # safe = 1 where scale == 0
    x_hat = q * scale + zero                            # a multiply, then an add: never an FMA

then ``x_hat`` is cast back to the input dtype (round to nearest even). Each line is one MLX op, so
no backend can contract or reorder them; the kernels spell out the same operations with
non-contracting intrinsics.

A zero-range group (all elements equal, scale == 0) divides by 1 instead, so every code is 0 and
``x_hat == zero``, which is exactly the constant value.

Keys are grouped per channel: ``G`` consecutive tokens of one channel (axis -2). Values are grouped per
token: ``G`` consecutive channels of one token (axis -1). A ragged last group is padded by repeating
its edge value, which leaves min and max unchanged; padded positions are dropped from the output.
"""

import mlx.core as mx

BITS = (2, 4, 8)


def _qmax(bits):
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    return float(2**bits - 1)


def _pad_edge(x, axis, group_size):
    n = x.shape[axis]
    extra = -n % group_size
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return mx.pad(x, widths, mode="edge")


def _group_keys(x, group_size):
    """[..., S, D] float32 -> [..., NG, G, D] (edge-padded along tokens); reduction axis -2."""
    x = _pad_edge(x, -2, group_size)
    *lead, s, d = x.shape
    return x.reshape(*lead, s // group_size, group_size, d)


def _group_values(x, group_size):
    """[..., S, D] float32 -> [..., S, NG, G] (edge-padded along channels); reduction axis -1."""
    x = _pad_edge(x, -1, group_size)
    *lead, d = x.shape
    return x.reshape(*lead, d // group_size, group_size)


def _params(xg, bits, axis):
    zero = mx.min(xg, axis=axis, keepdims=True)
    scale = (mx.max(xg, axis=axis, keepdims=True) - zero) / _qmax(bits)
    safe = mx.where(scale == 0, 1.0, scale)
    return scale, zero, safe


def _codes(xg, zero, safe, bits):
    return mx.clip(mx.round((xg - zero) / safe), 0.0, _qmax(bits))


def _fake_quant(xg, bits, axis):
    scale, zero, safe = _params(xg, bits, axis)
    q = _codes(xg, zero, safe, bits)
    return q * scale + zero, scale, zero


def _check(x, group_size):
    if x.ndim < 2:
        raise ValueError(f"expected [..., S, D], got shape {x.shape}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")


def fake_quant_keys(x, bits=4, group_size=32):
    """Quantize then dequantize keys per channel. x: [..., S, D].

    Returns ``(x_hat, scale, zero)``: x_hat in x.dtype with x's shape; scale and zero float32
    ``[..., ceil(S/G), D]``."""
    _check(x, group_size)
    s = x.shape[-2]
    xh, scale, zero = _fake_quant(_group_keys(x.astype(mx.float32), group_size), bits, -2)
    xh = xh.reshape(*x.shape[:-2], -1, x.shape[-1])[..., :s, :]
    return xh.astype(x.dtype), scale.squeeze(-2), zero.squeeze(-2)


def fake_quant_values(x, bits=4, group_size=32):
    """Quantize then dequantize values per token. x: [..., S, D].

    Returns ``(x_hat, scale, zero)``: x_hat in x.dtype with x's shape; scale and zero float32
    ``[..., S, ceil(D/G)]``."""
    _check(x, group_size)
    d = x.shape[-1]
    xh, scale, zero = _fake_quant(_group_values(x.astype(mx.float32), group_size), bits, -1)
    xh = xh.reshape(*x.shape[:-1], -1)[..., :d]
    return xh.astype(x.dtype), scale.squeeze(-1), zero.squeeze(-1)


def quantize_keys(x, bits=4, group_size=32):
    """Codes (uint8, x's shape), scale, zero (float32 ``[..., ceil(S/G), D]``) for keys."""
    _check(x, group_size)
    s = x.shape[-2]
    xg = _group_keys(x.astype(mx.float32), group_size)
    scale, zero, safe = _params(xg, bits, -2)
    q = _codes(xg, zero, safe, bits).reshape(*x.shape[:-2], -1, x.shape[-1])[..., :s, :]
    return q.astype(mx.uint8), scale.squeeze(-2), zero.squeeze(-2)


def quantize_values(x, bits=4, group_size=32):
    """Codes (uint8, x's shape), scale, zero (float32 ``[..., S, ceil(D/G)]``) for values."""
    _check(x, group_size)
    d = x.shape[-1]
    xg = _group_values(x.astype(mx.float32), group_size)
    scale, zero, safe = _params(xg, bits, -1)
    q = _codes(xg, zero, safe, bits).reshape(*x.shape[:-1], -1)[..., :d]
    return q.astype(mx.uint8), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_keys(q, scale, zero, group_size, dtype=mx.float32):
    """Inverse of :func:`quantize_keys`: ``q * scale + zero`` with scale/zero repeated over G tokens."""
    s = q.shape[-2]
    scale = mx.repeat(scale, group_size, axis=-2)[..., :s, :]
    zero = mx.repeat(zero, group_size, axis=-2)[..., :s, :]
    return (q.astype(mx.float32) * scale + zero).astype(dtype)


def dequantize_values(q, scale, zero, group_size, dtype=mx.float32):
    """Inverse of :func:`quantize_values`: scale/zero repeated over G channels."""
    d = q.shape[-1]
    scale = mx.repeat(scale, group_size, axis=-1)[..., :d]
    zero = mx.repeat(zero, group_size, axis=-1)[..., :d]
    return (q.astype(mx.float32) * scale + zero).astype(dtype)


def packed_nbytes(n_elements, n_groups, bits):
    """Bytes a packed store needs: ``bits`` per code (rounded up to whole bytes) plus an fp16 scale
    and an fp16 zero per group. What KIVI's memory saving is measured in; nothing here allocates it."""
    return (n_elements * bits + 7) // 8 + 4 * n_groups
