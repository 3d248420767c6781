"""The compiled codebook mat-vec (vqpipe/kernels/ext.py, csrc/): exact to float32 accumulation against a
float64 evaluation of the same formula, every width and scale layout, and the same greedy tokens
as the dense path in a model."""

import math
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from vqpipe.kernels import ext
from vqpipe.layers import fused
from vqpipe.codec.bitpack import pack
from vqpipe.codec.codebook import LAYER_BITS
from vqpipe.layers.qlinear import QuantizedLinear, dense_forward
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import quantize_model

from test_fused import _greedy

pytestmark = pytest.mark.skipif(not ext.available(), reason=f"vqpipe._ext is not built ({ext._missing})")

U32 = 2.0**-24
ROUND = {mx.float32: U32, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}


def _layer(rng, bits, out, n, group_size=None, bias=True):
    idx = rng.integers(0, 1 << bits, (out, n)).astype(np.uint8)
    cb = np.sort(rng.standard_normal(1 << bits)).astype(np.float32)
    if group_size:
        scales = (rng.random((out, n // group_size)) + 0.5).astype(np.float16)
    else:
        scales = (rng.random(out) + 0.5).astype(np.float32)
    b = rng.standard_normal(out).astype(np.float32) if bias else None
    return idx, pack(idx, bits), cb, scales, b


def _reference(x, idx, cb, scales, b, group_size):
    """float64 y and the float32 accumulation bound: (n + 2) u sum_i |s w_i x_i| + u |b| per entry."""
    w = cb[idx].astype(np.float64)
    if group_size:
        w = w * np.repeat(scales.astype(np.float64), group_size, axis=1)
    x = x.astype(np.float64)
    y, mag = x @ w.T, np.abs(x) @ np.abs(w).T
    if not group_size:
        y, mag = y * scales, mag * scales
    n = idx.shape[1]
    bound = (n + 2) * U32 * mag
    if b is not None:
        y, bound = y + b, bound + U32 * np.abs(b)
    return y, bound


def _run(x, packed, cb, scales, b, bits, group_size, dtype=mx.float32):
    return ext.matvec(mx.array(x).astype(dtype), mx.array(packed), mx.array(scales), mx.array(cb), bits,
                      None if b is None else mx.array(b), group_size)


@pytest.mark.parametrize("bits", LAYER_BITS)
@pytest.mark.parametrize("n", [576, 1536, 4864, 100])
@pytest.mark.parametrize("group_size", [None, 32, 64])
def test_exact_to_float32_accumulation(bits, n, group_size):
    if group_size and n % group_size:
        pytest.skip("group size does not divide in_features")
    rng = np.random.default_rng(bits * 1000 + n + (group_size or 0))
    out = 67  # odd: the thread split leaves unequal row ranges
    idx, packed, cb, scales, b = _layer(rng, bits, out, n, group_size, bias=bits % 2 == 0)
    for m in (*range(1, 9), 40):  # decode, small batches, and a prefill-size M (passes of 8 rows)
        x = rng.standard_normal((m, n)).astype(np.float32)
        y = np.array(_run(x, packed, cb, scales, b, bits, group_size))
        ref, bound = _reference(x, idx, cb, scales, b, group_size)
        assert y.shape == (m, out) and y.dtype == np.float32
        assert np.all(np.abs(y - ref) <= bound), (bits, n, group_size, m, np.max(np.abs(y - ref) / bound))


@pytest.mark.parametrize("group_size", [16, 48, 192])
def test_groups_across_blocks(group_size):
    """Group sizes that are not whole 32-value blocks: each value takes its own group's scale."""
    rng = np.random.default_rng(group_size)
    n, bits = 576, 3
    idx, packed, cb, scales, b = _layer(rng, bits, 50, n, group_size)
    x = rng.standard_normal((3, n)).astype(np.float32)
    ref, bound = _reference(x, idx, cb, scales, b, group_size)
    assert np.all(np.abs(np.array(_run(x, packed, cb, scales, b, bits, group_size)) - ref) <= bound)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_inputs_give_their_dtype(dtype):
    """x in float16/bfloat16: float32 accumulation, one rounding of y into x's dtype."""
    rng = np.random.default_rng(7)
    n, bits = 1536, 4
    idx, packed, cb, scales, b = _layer(rng, bits, 96, n, 64)
    x = np.array(mx.array(rng.standard_normal((2, 3, n)).astype(np.float32)).astype(dtype).astype(mx.float32))
    y = _run(x, packed, cb, scales, b, bits, 64, dtype)
    assert y.dtype == dtype and y.shape == (2, 3, 96)
    ref, bound = _reference(x.reshape(6, n), idx, cb, scales, b, 64)
    err = np.abs(np.array(y.astype(mx.float32)).reshape(6, 96) - ref)
    assert np.all(err <= bound + ROUND[dtype] * np.abs(ref))


def test_strided_operands():
    """A transposed x and a column slice of packed words' rows are read through their strides."""
    rng = np.random.default_rng(3)
    n, bits = 256, 4
    idx, packed, cb, scales, b = _layer(rng, bits, 40, n)
    x = rng.standard_normal((n, 5)).astype(np.float32)
    xt = mx.array(x).T  # not row-contiguous
    y = ext.matvec(xt, mx.array(packed)[::-1][::-1], mx.array(scales), mx.array(cb), bits, mx.array(b))
    ref, bound = _reference(x.T, idx, cb, scales, b, None)
    assert np.all(np.abs(np.array(y) - ref) <= bound)


def test_deterministic_and_rows_independent():
    """Each output row is one thread's fixed-order sum: the same bytes every call, and a row's value
    does not depend on the rows beside it (a fused q|k|v gives its siblings' bytes)."""
    rng = np.random.default_rng(5)
    n, bits = 576, 4
    idx, packed, cb, scales, b = _layer(rng, bits, 900, n)
    x = rng.standard_normal((4, n)).astype(np.float32)
    y = np.array(_run(x, packed, cb, scales, b, bits, None))
    assert np.array_equal(y, np.array(_run(x, packed, cb, scales, b, bits, None)))
    part = np.array(_run(x, packed[300:400], cb, scales[300:400], b[300:400], bits, None))
    assert np.array_equal(part, y[:, 300:400])


def test_bad_arguments_raise_one_clear_error():
    rng = np.random.default_rng(1)
    idx, packed, cb, scales, b = _layer(rng, 4, 8, 64)
    x = mx.array(rng.standard_normal((1, 64)).astype(np.float32))
    p, s, c = mx.array(packed), mx.array(scales), mx.array(cb)
    with pytest.raises(ValueError, match="bits must be one of"):
        ext.matvec(x, p, s, c, 7)
    with pytest.raises(ValueError, match="words per row"):
        ext.matvec(x[:, :32], p, s, c, 4)
    with pytest.raises(ValueError, match="per-row scales"):
        ext.matvec(x, p, s[:4], c, 4)
    with pytest.raises(ValueError, match="group scales"):
        ext.matvec(x, p, s, c, 4, None, 32)
    with pytest.raises(ValueError, match="does not divide"):
        ext.matvec(x, p, mx.zeros((8, 2), mx.float16), c, 4, None, 48)
    with pytest.raises(ValueError, match="codebook"):
        ext.matvec(x, p, s, c[:8], 4)
    with pytest.raises(ValueError, match="bias"):
        ext.matvec(x, p, s, c, 4, mx.zeros((3,)))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ext.matvec(x.astype(mx.int32), p, s, c, 4)


def test_jvp_and_no_vjp():
    rng = np.random.default_rng(2)
    idx, packed, cb, scales, b = _layer(rng, 4, 16, 64)
    p, s, c, bb = mx.array(packed), mx.array(scales), mx.array(cb), mx.array(b)
    x = mx.array(rng.standard_normal((2, 64)).astype(np.float32))
    t = mx.array(rng.standard_normal((2, 64)).astype(np.float32))
    _, (jt,) = mx.jvp(lambda v: ext.matvec(v, p, s, c, 4, bb), [x], [t])
    assert np.array_equal(np.array(jt), np.array(ext.matvec(t, p, s, c, 4)))  # linear: no bias
    with pytest.raises(ValueError, match="no vjp"):
        mx.grad(lambda v: ext.matvec(v, p, s, c, 4).sum())(x)


@pytest.fixture
def cpu_default():
    """The CPU as the default device: the layers route only CPU work to the extension (on a GPU host
    the default device is the GPU)."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(previous)


def test_layers_take_it_for_decode_only(cpu_default):
    """QuantizedLinear on the CPU: M <= MAX_M through the extension, larger M dense; both equal the
    float64 formula (the dense path to its own float32 rounding)."""
    rng = np.random.default_rng(4)
    w = mx.array(rng.standard_normal((200, 576)).astype(np.float32))
    import mlx.nn as nn

    lin = nn.Linear(576, 200)
    lin.weight = w
    q = QuantizedLinear.from_linear(lin, 4, "auto", seed=0)
    for m in (1, ext.MAX_M, ext.MAX_M + 1):
        x = mx.array(rng.standard_normal((m, 576)).astype(np.float32))
        assert ext.dispatch(x) == (m <= ext.MAX_M)
        got = np.array(q(x))
        with ext.using(False):
            assert not ext.dispatch(x)
            dense = np.array(q(x))
        scale = np.abs(dense).max()
        assert np.abs(got - dense).max() <= 1e-5 * scale
    with mx.stream(mx.cpu):
        assert ext.dispatch(mx.zeros((1, 576)))


def test_missing_module_warns_once(monkeypatch, cpu_default):
    monkeypatch.setattr(ext, "_ext", None)
    monkeypatch.setattr(ext, "_missing", ImportError("No module named 'vqpipe._ext'"))
    monkeypatch.setattr(ext, "_warned", False)
    x = mx.zeros((1, 64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not ext.dispatch(x) and not ext.dispatch(x)
    assert len(caught) == 1 and "vqpipe._ext is not built" in str(caught[0].message)
    assert "scripts/build_ext.sh" in str(caught[0].message)


@pytest.mark.parametrize("bits,group_size", [(4, None), (3, 64)])
def test_greedy_tokens_equal_the_dense_path(tiny_llama_source, bits, group_size):
    """tiny-llama (hidden 512, intermediate 1472) quantized with its tied head and fused siblings:
    greedy decode through the extension gives the dense path's tokens."""
    model, tok = load(str(tiny_llama_source))
    quantize_model(model, QuantizeConfig(bits, dtype=mx.float32, group_size=group_size, threads=1, calib_text="none"))
    assert fused.fused_groups(model)
    for text in ("The rotation spreads the outliers", "Lloyd-Max levels for a sphere", "a b c d e f g"):
        prompt = tok.encode(text)
        with ext.using(False):
            want = _greedy(model, prompt, 10)
        assert _greedy(model, prompt, 10) == want


@pytest.mark.parametrize("bits", LAYER_BITS)
def test_portable_kernel(bits):
    """The scalar kernel (machines without AVX2/FMA) under the same bound, per-row and group scales."""
    rng = np.random.default_rng(100 + bits)
    n = 1536
    previous = ext.module().set_portable(True)
    try:
        assert not ext.module().has_avx2()
        for group_size, m in ((None, 1), (64, 5), (48, 12)):
            idx, packed, cb, scales, b = _layer(rng, bits, 45, n, group_size)
            x = rng.standard_normal((m, n)).astype(np.float32)
            ref, bound = _reference(x, idx, cb, scales, b, group_size)
            assert np.all(np.abs(np.array(_run(x, packed, cb, scales, b, bits, group_size)) - ref) <= bound)
    finally:
        ext.module().set_portable(previous)
