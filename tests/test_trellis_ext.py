"""The compiled trellis kernels (csrc/trellis.cpp, vqpipe._ext) against vqpipe.codec.trellis's numpy
reference: the Viterbi gives exactly the reference's states (ties included), the mat-vec the dense
reconstruction's product to float32 accumulation."""

import mlx.core as mx
import numpy as np
import pytest

from vqpipe.codec import trellis
from vqpipe.kernels import dequant, ext

_ext = ext.module()
pytestmark = pytest.mark.skipif(
    not hasattr(_ext, "trellis_viterbi"), reason=f"vqpipe._ext is not built with the trellis kernels ({ext._missing})")

U32 = 2.0**-24


@pytest.fixture(params=[False, True], ids=["avx2", "portable"])
def portable(request):
    """The CPU kernel, portable or AVX2, on the CPU device also where the default is a GPU (there
    trellis.matvec would take the dense reference, whose float32 matmul CUDA runs as TF32)."""
    if not request.param and not _ext.has_avx2():
        pytest.skip("no AVX2 here")
    previous, device = _ext.set_portable(request.param), mx.default_device()
    mx.set_default_device(mx.cpu)
    yield request.param
    mx.set_default_device(device)
    _ext.set_portable(previous)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 8])
def test_viterbi_is_the_reference(k, portable):
    L, T = 10, trellis.TILE_ROWS * trellis.GROUP
    tab = trellis.table(L)
    x = np.random.default_rng(k).standard_normal((6, T)).astype(np.float32) * 1.3
    ref = trellis._viterbi_numpy(x, L, k, tab)
    assert np.array_equal(_ext.trellis_viterbi(x, tab, k), ref)
    assert np.array_equal(_ext.trellis_viterbi(x, tab, k, 1), ref)  # one thread: the same
    got = trellis.viterbi(x, L, k, tab)  # the public function takes the kernel
    assert got.dtype == np.int64 and np.array_equal(got, ref)


@pytest.mark.parametrize("L,k", [(4, 2), (6, 3), (12, 2), (8, 1)])
def test_viterbi_other_state_sizes(L, k, portable):
    tab = trellis.table(L)
    x = np.random.default_rng(L).standard_normal((5, 64)).astype(np.float32)
    assert np.array_equal(_ext.trellis_viterbi(x, tab, k), trellis._viterbi_numpy(x, L, k, tab))


def test_viterbi_ties_break_as_the_reference(portable):
    """A table of few distinct values and inputs on them: many equal-cost paths; the first
    predecessor and the lowest final state win, as numpy's argmin."""
    L, k = 10, 2
    tab = np.round(trellis.table(L) * 2) / 2  # a handful of levels, many states on each
    rng = np.random.default_rng(3)
    x = rng.choice(np.unique(tab), (8, 256)).astype(np.float32)
    ref = trellis._viterbi_numpy(x, L, k, tab)
    assert np.array_equal(_ext.trellis_viterbi(x, tab, k), ref)


def test_viterbi_rejects_bad_arguments():
    tab = trellis.table(10)
    x = np.zeros((2, 256), np.float32)
    with pytest.raises(ValueError, match="2\\^L"):
        _ext.trellis_viterbi(x, tab[:1000], 2)
    with pytest.raises(ValueError, match="non-finite"):
        _ext.trellis_viterbi(np.full((1, 8), np.nan, np.float32), tab, 2)
    nan = np.zeros((1, 256), np.float32)
    nan[0, 3] = np.inf  # the public function keeps the reference's behaviour there
    assert np.array_equal(trellis.viterbi(nan, 10, 2, tab), trellis._viterbi_numpy(nan, 10, 2, tab))


def _layer(rng, rows, cols, k):
    packed = rng.integers(0, 1 << 32, (rows // 32, cols // 8 * 8 * k), dtype=np.uint64).astype(np.uint32)
    scales = (rng.random(rows) + 0.5).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    return packed, scales, bias


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("rows,cols", [(32, 8), (96, 576), (576, 200), (1024, 64)])
def test_matvec_is_the_dense_product(k, rows, cols, portable):
    rng = np.random.default_rng(k * 7 + rows + cols)
    packed, scales, bias = _layer(rng, rows, cols, k)
    w = scales[:, None].astype(np.float64) * trellis.decode(packed, rows, cols, k)
    for m, b in ((1, None), (2, bias), (5, bias)):
        x = rng.standard_normal((m, cols)).astype(np.float32)
        y = trellis.matvec(mx.array(x), mx.array(packed), mx.array(scales), k, bias=None if b is None else mx.array(b))
        ref = x @ w.T + (0 if b is None else b)
        bound = (cols + 2) * U32 * (np.abs(x) @ np.abs(w).T) + (0 if b is None else U32 * np.abs(b))
        assert y.shape == (m, rows) and y.dtype == mx.float32
        assert np.all(np.abs(np.array(y) - ref) <= bound), (k, rows, cols, m)


@pytest.mark.parametrize("k,L", [(1, 10), (2, 10), (3, 10), (4, 10), (5, 10), (6, 10), (2, 8), (3, 12), (4, 16)])
def test_matvec_computes_the_table_to_the_bit(k, L, portable):
    """One-hot inputs read single weights: the kernel's computed 1MAD code is the table's value."""
    rng = np.random.default_rng(k + 10 * L)
    rows, cols = 64, 48
    packed, _, _ = _layer(rng, rows, cols, k)
    eye = mx.array(np.eye(cols, dtype=np.float32))
    y = trellis.matvec(eye, mx.array(packed), mx.ones((rows,)), k, L)
    assert np.array_equal(np.array(y).T, trellis.decode(packed, rows, cols, k, L))


def test_table_is_the_normalised_1mad_code():
    """table() is the experiment's normalised 1MAD code to an ulp or two, rounded once from
    a * byte_sum + b (the FMA the kernel computes: test above)."""
    t = trellis.table(10, 1.05)
    v = trellis.code_1mad(np.arange(1024))
    assert np.max(np.abs(t - (v - v.mean()) / v.std() * 1.05)) < 1e-6
    assert abs(float(t.mean())) < 1e-5 and abs(float(t.std()) - 1.05) < 1e-5


def test_matvec_of_quantized_blocks_and_dtypes():
    """quantize's blocks, concatenated, decode to the values it chose; half inputs give their dtype."""
    rng = np.random.default_rng(11)
    rows, cols, k = 64, 32, 2
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    blocks = [trellis.quantize(w[:, c:c + 8], k) for c in range(0, cols, 8)]
    packed = np.concatenate([p for p, _ in blocks], axis=1)
    values = np.concatenate([v for _, v in blocks], axis=1)
    assert np.array_equal(trellis.decode(packed, rows, cols, k), values)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    scales = np.ones(rows, np.float32)
    y = trellis.matvec(mx.array(x).astype(mx.bfloat16), mx.array(packed), mx.array(scales), k)
    assert y.dtype == mx.bfloat16 and y.shape == (3, rows)
    ref = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32)) @ values.T
    assert np.allclose(np.array(y.astype(mx.float32)), ref, rtol=2e-2, atol=2e-2)


def test_matvec_rejects_shapes_that_are_not_tiles():
    rng = np.random.default_rng(0)
    packed, scales, _ = _layer(rng, 64, 64, 2)
    p, s = mx.array(packed), mx.array(scales)
    with pytest.raises(ValueError, match=r"\(64, 60\)"):
        trellis.matvec(mx.zeros((1, 60)), p, s, 2)
    a, b = map(float, trellis.code_affine())
    with pytest.raises(ValueError, match="multiple of 8"):
        _ext.trellis_matvec(mx.zeros((1, 60)), p, s, 2, 10, a, b)
    with pytest.raises(ValueError, match="uint32"):
        _ext.trellis_matvec(mx.zeros((1, 64)), p, s, 3, 10, a, b)
    with pytest.raises(ValueError, match="scales"):
        _ext.trellis_matvec(mx.zeros((1, 64)), p, s[:40], 2, 10, a, b)
    with pytest.raises(ValueError, match="L = 20"):
        _ext.trellis_matvec(mx.zeros((1, 64)), p, s, 2, 20, a, b)
    with pytest.raises(ValueError, match=r"\(40, 64\)"):
        trellis.decode(packed, 40, 64, 2)
    with pytest.raises(ValueError, match=r"\(33, 8\)"):
        trellis.quantize(np.zeros((33, 8), np.float32), 2)


@pytest.mark.parametrize("k,L", [(1, 10), (2, 10), (3, 10), (4, 10), (5, 10), (6, 10), (2, 8), (3, 12), (4, 16), (6, 16)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_decode_is_the_mlx_decode_to_the_bit(k, L, dtype):
    """ext.trellis_decode (prefill's dense weight, written once) gives the MLX-op decode's values
    bit for bit in every dtype: the table's value of every state, cast the same way."""
    rng = np.random.default_rng(7 * k + L)
    rows, cols = 96, 200
    packed = mx.array(rng.integers(0, 2**32, (rows // 32, cols // 8 * 8 * k), dtype=np.uint32))
    table = mx.array(trellis.table(L, trellis.SCALE))
    with mx.stream(mx.cpu):
        got = ext.trellis_decode(packed, k, L, trellis.SCALE, cols, dtype)
        with ext.using(False):  # the MLX ops
            want = dequant.trellis_values(packed, table, k, rows, cols, L, dtype, trellis.SCALE)
        assert got.dtype == dtype and got.shape == (rows, cols)
        assert mx.array_equal(got, want).item()
    if dtype == mx.float32:  # and both are the numpy reference's
        ref = trellis.decode(np.array(packed), rows, cols, k, L, trellis.table(L, trellis.SCALE))
        assert np.array_equal(np.array(got), ref)


def test_dense_path_decodes_through_the_extension(monkeypatch):
    """A trellis layer's prefill (M > ext.MAX_M) and its dequantized weight decode with
    ext.trellis_decode where the extension runs, and give what the MLX ops give."""
    import mlx.nn as nn

    from vqpipe.layers.qlinear import QuantizedLinear

    rng = np.random.default_rng(3)
    lin = nn.Linear(320, 192)
    lin.weight = mx.array(rng.standard_normal((192, 320)).astype(np.float32) * 0.05)
    with mx.stream(mx.cpu):
        layer = QuantizedLinear.from_linear(lin, 2, "auto", 0, codes="trellis")
        x = mx.array(rng.standard_normal((ext.MAX_M + 3, 320)).astype(np.float32))
        calls = []
        real = ext.trellis_decode
        monkeypatch.setattr(ext, "trellis_decode", lambda *a: calls.append(a) or real(*a))
        y, w = layer(x), layer.dequantized_weight()
        assert len(calls) == 2
        with ext.using(False):
            assert mx.array_equal(layer(x), y).item() and mx.array_equal(layer.dequantized_weight(), w).item()


def test_decode_rejects_bad_arguments():
    packed = mx.zeros((2, 16), mx.uint32)
    with pytest.raises(ValueError, match="multiple of 8"):
        _ext.trellis_decode(packed, 2, 10, 1.0, 0.0, 60, mx.float32)
    assert _ext.trellis_decode(packed, 2, 10, 1.0, 0.0, 8, mx.float32).shape == (64, 8)
    with pytest.raises(ValueError, match=r"uint32 \[rows / 32, 32\] for 16 columns at k = 2, got \(2, 16\)"):
        _ext.trellis_decode(packed, 2, 10, 1.0, 0.0, 16, mx.float32)
    with pytest.raises(ValueError, match="L = 20"):
        _ext.trellis_decode(packed, 2, 20, 1.0, 0.0, 8, mx.float32)
    with pytest.raises(ValueError, match="dtype"):
        _ext.trellis_decode(packed, 2, 10, 1.0, 0.0, 8, mx.int32)


# ---- the CUDA kernel (csrc/trellis.cu): on a CUDA build only ----------------------------------------

gpu = pytest.mark.skipif(not (_ext is not None and _ext.has_gpu() and mx.default_device() != mx.cpu),
                         reason="needs vqpipe._ext built against a CUDA MLX, on a GPU")


def _gpu_and_cpu(x, packed, scales, k, L, bias):
    a, b = map(float, trellis.code_affine(L))
    args = (mx.array(packed), mx.array(scales), k, L, a, b, None if bias is None else mx.array(bias))
    y_gpu = _ext.trellis_matvec(x, *args, stream=mx.gpu)
    y_cpu = _ext.trellis_matvec(x, *args, stream=mx.cpu)
    return y_gpu, y_cpu


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k,L", [(1, 10), (2, 10), (3, 10), (4, 10), (5, 10), (6, 10), (2, 8), (3, 12), (4, 16), (6, 16)])
def test_gpu_matvec_computes_the_table_to_the_bit(k, L):
    """One-hot inputs read single weights: every state the CUDA kernel forms (the window before each
    lane's first weight included) gives the table's value, in every row and column of a tile."""
    rng = np.random.default_rng(k + 10 * L)
    rows, cols = 96, 48
    packed, _, _ = _layer(rng, rows, cols, k)
    eye = mx.eye(cols)
    values = trellis.decode(packed, rows, cols, k, L)
    for m0 in (0, 8, 40):  # one launch takes at most 8 rows of x
        y, _ = _gpu_and_cpu(eye[m0:m0 + 8], packed, np.ones(rows, np.float32), k, L, None)
        assert np.array_equal(np.array(y).T, values[:, m0:m0 + 8]), (k, L, m0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("rows,cols", [(32, 8), (96, 576), (576, 200), (64, 1544)])
def test_gpu_matvec_is_the_dense_product(k, rows, cols):
    """Against the float64 product within float32 accumulation's bound, for 1 to 17 rows of x (three
    launches), with and without bias, float16 scales cast by the op; the same bits on a second run."""
    rng = np.random.default_rng(k * 7 + rows + cols)
    packed, scales, bias = _layer(rng, rows, cols, k)
    w = scales[:, None].astype(np.float64) * trellis.decode(packed, rows, cols, k)
    for m, b in ((1, None), (3, bias), (8, bias), (17, None)):
        x = rng.standard_normal((m, cols)).astype(np.float32)
        y, y_cpu = _gpu_and_cpu(mx.array(x), packed, scales, k, 10, b)
        ref = x @ w.T + (0 if b is None else b)
        bound = (cols + 2) * U32 * (np.abs(x) @ np.abs(w).T) + (0 if b is None else U32 * np.abs(b))
        assert y.shape == (m, rows) and y.dtype == mx.float32
        assert np.all(np.abs(np.array(y) - ref) <= bound), (k, rows, cols, m)
        assert np.all(np.abs(np.array(y_cpu) - ref) <= bound)
        again, _ = _gpu_and_cpu(mx.array(x), packed, scales, k, 10, b)
        assert np.array_equal(np.array(again), np.array(y))  # a fixed order of sums
    half = _ext.trellis_matvec(mx.array(x), mx.array(packed), mx.array(scales).astype(mx.float16), k, 10,
                               *map(float, trellis.code_affine(10)), stream=mx.gpu)
    w16 = np.array(mx.array(scales).astype(mx.float16).astype(mx.float32))[:, None].astype(np.float64) \
        * trellis.decode(packed, rows, cols, k)
    bound = (cols + 2) * U32 * (np.abs(x) @ np.abs(w16).T)
    assert np.all(np.abs(np.array(half) - x @ w16.T) <= bound)


@pytest.mark.gpu
@gpu
def test_gpu_kernels_wait_for_inputs_made_in_the_same_graph():
    """Operands computed by other ops of the same evaluation and 17 rows of x (more than one block's
    8): every block of the launch reads them after they are written, and the op's readers see every
    row. (Launches of 8 rows each once raced here: MLX's encoder gives only the first node of an
    eval_gpu the inputs' dependencies; the later ones read the scales before their cast wrote them.)"""
    from vqpipe.codec.bitpack import pack

    rng = np.random.default_rng(9)
    rows, cols, k = 96, 576, 2
    packed, scales, bias = _layer(rng, rows, cols, k)
    x = rng.standard_normal((17, cols)).astype(np.float32)
    a, b = map(float, trellis.code_affine(10))
    for _ in range(3):
        lazy_x = mx.array(x) * 3.0 / 3.0  # made on the GPU in the same graph as the kernel
        lazy_s = (mx.array(scales) * 1.0).astype(mx.float16)  # cast to float32 by the op
        y = _ext.trellis_matvec(lazy_x, mx.array(packed), lazy_s, k, 10, a, b, mx.array(bias) + 0.0,
                                stream=mx.gpu) * 1.0
        s16 = mx.array(scales).astype(mx.float16).astype(mx.float32)
        ref16 = _ext.trellis_matvec(mx.array(x), mx.array(packed), s16, k, 10, a, b, mx.array(bias), stream=mx.cpu)
        assert np.allclose(np.array(y), np.array(ref16), rtol=1e-5, atol=1e-4)
    idx = rng.integers(0, 4, (rows, cols)).astype(np.uint8)
    cb = np.sort(rng.standard_normal(4)).astype(np.float32)
    want = ext.matvec(mx.array(x), mx.array(pack(idx, 2)), mx.array(scales), mx.array(cb), 2, mx.array(bias))
    mx.eval(want)
    got = ext.matvec(mx.array(x) * 3.0 / 3.0, mx.array(pack(idx, 2)), mx.array(scales) * 1.0, mx.array(cb) * 1.0,
                     2, mx.array(bias) + 0.0) * 1.0
    assert np.allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_gpu_matvec_half_inputs(dtype):
    rng = np.random.default_rng(5)
    rows, cols, k = 128, 256, 2
    packed, scales, bias = _layer(rng, rows, cols, k)
    x = mx.array(rng.standard_normal((2, cols)).astype(np.float32)).astype(dtype)
    y, y_cpu = _gpu_and_cpu(x, packed, scales, k, 10, bias)
    assert y.dtype == dtype and y.shape == (2, rows)
    assert np.allclose(np.array(y.astype(mx.float32)), np.array(y_cpu.astype(mx.float32)), rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
@gpu
def test_gpu_trellis_layer_decodes_through_the_kernel():
    """A trellis QuantizedLinear on the GPU: decode rows (M <= ext.GPU_MAX_M) take the kernel, a
    prefill-sized input the dense reconstruction; both the same function of x."""
    import mlx.nn as nn

    from vqpipe.layers.qlinear import QuantizedLinear

    rng = np.random.default_rng(2)
    rows, cols = 192, 320
    lin = nn.Linear(cols, rows)
    lin.weight = mx.array(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05)
    with mx.stream(mx.cpu):
        layer = QuantizedLinear.from_linear(lin, 2, "auto", 0, codes="trellis")
    assert ext.gpu_dispatch(mx.zeros((1, cols)))
    assert not ext.gpu_dispatch(mx.zeros((ext.GPU_MAX_M + 1, cols)))
    x = mx.array(rng.standard_normal((ext.GPU_MAX_M + 1, cols)).astype(np.float32))
    dense = layer(x)
    rows_by_kernel = mx.concatenate([layer(x[i:i + 1]) for i in range(x.shape[0])])
    # the dense path's float32 matmul runs as TF32 on CUDA (a 10-bit mantissa): ~5e-4 apart on the H100
    assert np.allclose(np.array(rows_by_kernel), np.array(dense), rtol=4e-3, atol=4e-3)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k,L", [(1, 10), (2, 10), (3, 10), (4, 10), (5, 10), (6, 10), (2, 8), (3, 12), (4, 16), (6, 16)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_gpu_decode_is_the_cpu_decode(k, L, dtype):
    rng = np.random.default_rng(5 * k + L)
    rows, cols = 128, 1544
    packed = mx.array(rng.integers(0, 2**32, (rows // 32, cols // 8 * 8 * k), dtype=np.uint32))
    a, b = map(float, trellis.code_affine(L))
    got = _ext.trellis_decode(packed, k, L, a, b, cols, dtype, stream=mx.gpu)
    want = _ext.trellis_decode(packed, k, L, a, b, cols, dtype, stream=mx.cpu)
    assert mx.array_equal(got, want).item()


@pytest.mark.gpu
@pytest.mark.skipif(mx.default_device() == mx.cpu or not mx.metal.is_available(), reason="needs Metal (untested: no Apple machine)")
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_metal_matvec_is_the_cpu_kernel(k):
    from vqpipe.kernels import trellis_metal

    rng = np.random.default_rng(k)
    rows, cols = 96, 1544
    packed, scales, bias = _layer(rng, rows, cols, k)
    for m, b in ((1, None), (3, bias), (8, bias)):
        x = mx.array(rng.standard_normal((m, cols)).astype(np.float32))
        y = trellis_metal.matvec(x, mx.array(packed), mx.array(scales), k, 10, trellis.SCALE,
                                 None if b is None else mx.array(b))
        ref = trellis.matvec(x, mx.array(packed), mx.array(scales), k, bias=None if b is None else mx.array(b))
        assert np.allclose(np.array(y), np.array(ref), rtol=1e-4, atol=1e-4)


def test_metal_kernel_is_not_taken_off_metal():
    from vqpipe.kernels import trellis_metal

    if mx.metal.is_available():
        pytest.skip("Metal here")
    assert not trellis_metal.dispatch(mx.zeros((1, 64)))
    with pytest.raises(ValueError, match="M = 9"):
        trellis_metal.matvec(mx.zeros((9, 64)), mx.zeros((2, 16), mx.uint32), mx.ones((64,)), 2, 10, trellis.SCALE)


@pytest.mark.parametrize("k,L", [(1, 10), (2, 10), (3, 10), (4, 10), (5, 10), (6, 10), (2, 8), (3, 12), (4, 16), (6, 16),
                                 (5, 16), (1, 16)])
def test_gpu_kernels_window_arithmetic(k, L):
    """The CUDA and Metal kernels' per-lane decode (csrc/trellis.cu, vqpipe/kernels/trellis_metal.py),
    replayed in Python integers: lane l reads one 64-bit window from 3 words starting n - 1 steps
    before weight 8l (shifted up where that is before the tile), runs n - 1 steps, then its 8
    weights. Every state equals the stream's (the reference decoder's), for every lane and width;
    and the window never needs more than 64 bits. (Where no GPU is, this is what checks the
    kernels' indexing.)"""
    rng = np.random.default_rng(k * 31 + L)
    packed, _, _ = _layer(rng, 32, 8, k)
    words = [int(w) for w in packed[0]] + [0, 0]  # the kernels' two zero pad words
    n = -(-L // k)
    assert (n + 7) * k <= 64
    mask, kmask = (1 << L) - 1, (1 << k) - 1
    steps = [(sum(w << (32 * i) for i, w in enumerate(words)) >> (k * i)) & kmask for i in range(256)]
    want, s = [], 0
    for b in steps:
        s = ((s << k) | b) & mask
        want.append(s)
    for lane in range(32):
        first = 8 * lane - (n - 1)
        p0, pad = (0, -k * first) if first < 0 else (k * first, 0)
        wi, sh = p0 >> 5, p0 & 31
        lo = words[wi] | (words[wi + 1] << 32)
        win = ((lo >> sh) | (words[wi + 2] << (64 - sh))) & (2**64 - 1) if sh else lo
        win = (win << pad) & (2**64 - 1)
        s = 0
        for j in range(n - 1):
            s = ((s << k) | ((win >> (k * j)) & kmask)) & mask
        win >>= k * (n - 1)
        for r in range(8):
            s = ((s << k) | ((win >> (k * r)) & kmask)) & mask
            assert s == want[8 * lane + r], (k, L, lane, r)
