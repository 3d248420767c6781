"""Reference KIVI quantizer (vqpipe.kivi.quantizer): the properties the kernels are held to."""

import mlx.core as mx
import numpy as np
import pytest

from vqpipe.kivi import quantizer

KINDS = {
    "keys": (quantizer.fake_quant_keys, quantizer.quantize_keys, quantizer.dequantize_keys),
    "values": (quantizer.fake_quant_values, quantizer.quantize_values, quantizer.dequantize_values),
}


def _expand(p, kind, g, shape):
    """Per-group scale/zero broadcast back to per-element, shape [..., S, D]."""
    axis = -2 if kind == "keys" else -1
    n = shape[axis]
    p = mx.repeat(p, g, axis=axis)
    return p[..., :n, :] if kind == "keys" else p[..., :n]


def _bits_of(x):
    view = {2: mx.uint16, 4: mx.uint32}[x.dtype.size]
    return np.array(x.view(view))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", quantizer.BITS)
@pytest.mark.parametrize("g", [32, 48])
def test_round_trip_error_bound(kind, bits, g):
    mx.random.seed(bits * 100 + g)
    x = mx.random.normal((2, 3, 70, 64)) * 3.0 + 0.5  # 70 tokens and G=48 on 64 channels: ragged
    fake, _, _ = KINDS[kind]
    xh, scale, zero = fake(x, bits, g)
    assert xh.shape == x.shape and xh.dtype == x.dtype
    s = _expand(scale, kind, g, x.shape)
    err = mx.abs(xh - x)
    # rint puts every element within half a step of its code; float32 rounding adds a few ulps.
    assert mx.all(err <= s * 0.5 * (1 + 1e-5) + 1e-6).item()
    lo, hi = _expand(zero, kind, g, x.shape), _expand(zero + scale * (2**bits - 1), kind, g, x.shape)
    assert mx.all((xh >= lo - 1e-5) & (xh <= hi + 1e-5)).item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", quantizer.BITS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_round_half_to_even(kind, bits, dtype):
    # Group [0, qmax*step, step/2, 3*step/2, ...]: zero = 0 and scale = step exactly, so
    # (x - zero) / scale lands exactly on k + 0.5 and rint must pick the even neighbour.
    qmax, step = 2**bits - 1, 0.5 if (dtype == mx.bfloat16 and bits == 8) else 2.0
    row = np.resize(np.concatenate([[0.0, qmax * step], np.arange(1, 2 * qmax, 2) * step / 2]), 32)
    want_q = np.rint(row / step)  # numpy rint: half to even
    assert np.any(want_q != np.floor(row / step + 0.5))  # the ties do occur
    grp = mx.array(row.astype(np.float32)).reshape(1, 1, 1, 32)
    x = (grp.swapaxes(-1, -2) if kind == "keys" else grp).astype(dtype)  # keys: one channel, G tokens
    assert np.array_equal(np.array(x.astype(mx.float32)).reshape(-1), row)
    fake, quantize, _ = KINDS[kind]
    q, scale, zero = quantize(x, bits, 32)
    assert np.array(q).reshape(-1).tolist() == want_q.tolist()
    assert scale.reshape(-1).tolist() == [step] and zero.reshape(-1).tolist() == [0.0]
    xh = fake(x, bits, 32)[0]
    assert np.array(xh.astype(mx.float32)).reshape(-1).tolist() == (step * want_q).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_ragged_group_repeats_edge_value(kind):
    mx.random.seed(3)
    g = 32
    # All positive: zero padding would drag min to 0; edge padding must leave it alone.
    x = mx.random.uniform(5.0, 9.0, (1, 2, 45, 40))
    fake = KINDS[kind][0]
    xh, scale, zero = fake(x, 4, g)
    axis = -2 if kind == "keys" else -1
    n = x.shape[axis]
    pad = [(0, 0)] * 4
    pad[axis] = (0, -n % g)
    xe = mx.pad(x, pad, mode="edge")
    xh_e, scale_e, zero_e = fake(xe, 4, g)
    keep = (slice(None),) * 2 + ((slice(0, n), slice(None)) if kind == "keys" else (slice(None), slice(0, n)))
    assert np.array_equal(np.array(xh), np.array(xh_e[keep]))
    assert np.array_equal(np.array(scale), np.array(scale_e)) and np.array_equal(np.array(zero), np.array(zero_e))
    # The ragged group's parameters come from its real elements only.
    tail = x[:, :, 32:, :] if kind == "keys" else x[..., 32:]
    lo = tail.min(axis=axis)
    assert mx.all(lo >= 5.0).item()
    last = zero[:, :, -1, :] if kind == "keys" else zero[..., -1]
    assert np.array_equal(np.array(last), np.array(lo))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_zero_range_group_is_exact(kind, dtype):
    x = mx.random.normal((1, 2, 64, 64)).astype(dtype)
    const = mx.array(-1.375, dtype)
    if kind == "keys":
        x[:, :, :32, :] = const  # the first token group of every channel is constant
    else:
        x[..., :32] = const  # the first channel group of every token is constant
    fake, quantize, _ = KINDS[kind]
    xh, scale, zero = fake(x, 4, 32)
    q = quantize(x, 4, 32)[0]
    first = (slice(None), slice(None), slice(0, 32)) if kind == "keys" else (..., slice(0, 32))
    p_first = (slice(None), slice(None), 0) if kind == "keys" else (..., 0)
    assert mx.all(scale[p_first] == 0).item()
    assert mx.all(q[first] == 0).item()
    assert np.array_equal(_bits_of(xh[first]), _bits_of(x[first]))
    assert not mx.any(mx.isnan(xh)).item() and not mx.any(mx.isinf(xh)).item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_codes_dequantize_to_fake_quant(kind, dtype):
    mx.random.seed(11)
    x = (mx.random.normal((1, 4, 50, 128)) * 2).astype(dtype)
    fake, quantize, dequantize = KINDS[kind]
    q, scale, zero = quantize(x, 4, 32)
    assert q.dtype == mx.uint8 and int(q.max().item()) <= 15
    back = dequantize(q, scale, zero, 32, dtype)
    assert np.array_equal(_bits_of(back), _bits_of(fake(x, 4, 32)[0]))


def test_input_checks_and_packed_size():
    x = mx.zeros((1, 1, 4, 8))
    with pytest.raises(ValueError):
        quantizer.fake_quant_keys(x, bits=0)
    with pytest.raises(ValueError):
        quantizer.fake_quant_values(x, bits=9)
    with pytest.raises(ValueError):
        quantizer.fake_quant_keys(mx.zeros((8,)))
    # 4 bits: 64 codes -> 32 bytes, plus 2 groups x (fp16 scale + fp16 zero).
    assert quantizer.packed_nbytes(64, 2, 4) == 32 + 8
    assert quantizer.packed_nbytes(3, 1, 2) == 1 + 4
