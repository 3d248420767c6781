"""qmv revision 8 (vqpipe/kernels/qmv_tc.py), the tensor-core mat-vec.

CPU: the repacking, the kernel's input order and pair table, and the whole kernel emulated in numpy
from the same index rules (the packed words at the kernel's offsets, the table bytes the kernel's
shifts select, the activation words it loads) with the mma fragments placed by the PTX ISA's layout
of m16n8k16 (written out here independently): it must equal the formula within the hi + lo
residual. GPU: the kernel against float64 (the bound below), greedy tokens with it on and off.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

from vqpipe.kernels import qmv, qmv_tc
from vqpipe.codec.bitpack import pack, unpack


def _codes(rng, n, k):
    return rng.integers(0, 16, (n, k)).astype(np.uint8)


def _words(codes):
    return pack(codes, 4)


def test_repack_puts_each_lanes_words_where_the_kernel_reads_them():
    rng = np.random.default_rng(0)
    n, k = 40, 256  # 3 row blocks (the last padded), 2 chunks
    w = _words(_codes(rng, n, k))
    r = qmv_tc.repack(w)
    nb, nc = 3, 2
    assert r.shape == (nb * nc * 256,) and r.dtype == np.uint32
    for rb in range(nb):
        for c in range(nc):
            for h in range(2):
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    for p in range(4):
                        row = 16 * rb + 8 * h + g
                        want = w[row, c * 16 + 4 * p + t] if row < n else 0
                        assert r[(rb * nc + c) * 256 + (h * 32 + lane) * 4 + p] == want
    assert np.array_equal(np.asarray(qmv_tc.repack(mx.array(w))), r)  # the MLX path gives the same words


def test_repack_rejects_partial_chunks():
    with pytest.raises(ValueError, match="128-input chunks"):
        qmv_tc.repack(np.zeros((16, 8), np.uint32))


def test_input_order_is_a_permutation_of_each_tile_pair():
    for tile in range(8):
        got = sorted(qmv_tc.input_of(tile, k) for k in range(16))
        p, s = divmod(tile, 2)
        assert set(got) <= set(range(32 * p, 32 * p + 32)) and len(set(got)) == 16
    assert sorted(qmv_tc.input_of(t, k) for t in range(8) for k in range(16)) == list(range(128))


def test_pair_table_hi_lo_residual():
    rng = np.random.default_rng(1)
    cb = (rng.standard_normal(16) * 0.02).astype(np.float32)
    hi, lo = qmv_tc.pair_table(cb)
    val = lambda w: qmv_tc._bf16_value(w & 0xFFFF).astype(np.float64)  # noqa: E731
    for e in (0, 17, 255, 0x4F):
        a = e & 15
        resid = abs(cb[a].astype(np.float64) - val(hi[e]) - val(lo[e]))
        assert resid <= 2.0**-16 * abs(float(cb[a]))
        assert val(hi[e] >> 16) == qmv_tc._bf16_value(qmv_tc._bf16_bits(cb[e >> 4]))


# The PTX ISA's m16n8k16 .bf16 fragments (lane = 4 * groupID + threadID_in_group), element h of register j.
def _a_pos(lane, j, h):
    g, t = divmod(lane, 4)
    return g + 8 * (j % 2), 2 * t + h + 8 * (j // 2)  # (row, k)


def _b_pos(lane, j, h):
    g, t = divmod(lane, 4)
    return 2 * t + h + 8 * j, g  # (k, column)


def _d_pos(lane, i):
    g, t = divmod(lane, 4)
    return g + 8 * (i // 2), 2 * t + i % 2  # (row, column)


def _entry(w, byte, lane):
    """qtc_pair<B>: the table slot the kernel reads (byte extract, * 128 + the lane's copy * 8) as
    (entry, copy)."""
    addr = (((int(w) >> (8 * byte)) & 0xFF) << 7) + ((lane & 15) << 3)
    return addr >> 7, (addr >> 3) & 15


def _halves(word):
    return [float(qmv_tc._bf16_value(np.uint32((int(word) >> (16 * h)) & 0xFFFF))) for h in range(2)]


def emulate(x_bits, repacked, n_out, scales, codebook, group_size=None):
    """The kernel's arithmetic in float64 (products and sums exact here), indices as the kernel's: per
    tile and row half h one mma whose A rows 0-7 hold hi and rows 8-15 lo of rows 8h .. 8h + 7."""
    hi, lo = qmv_tc.pair_table(codebook)
    m, k = x_bits.shape
    nc, nb = k // 128, -(-n_out // 16)
    words = repacked.reshape(nb, nc, 2, 32, 4)
    y = np.zeros((m, nb * 16))
    for rb in range(nb):
        acc = np.zeros((2, 16, 8))
        for c in range(nc):
            for p in range(4):
                for s in range(2):
                    b_mat = np.zeros((16, 8))
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        if g < m:  # b: the 16 bytes at x + g * K + c * 128 + 32p + 8t
                            xw = x_bits[g, c * 128 + 32 * p + 8 * t:][:8]
                            for j in range(2):
                                for h in range(2):
                                    b_mat[_b_pos(lane, j, h)] = float(qmv_tc._bf16_value(xw[4 * s + 2 * j + h]))
                    for h in range(2):
                        a = np.zeros((16, 16))
                        for lane in range(32):
                            w = words[rb, c, h, lane, p]
                            regs = []
                            for byte in (2 * s, 2 * s + 1):
                                e, copy = _entry(w, byte, lane)
                                assert copy == lane % 16  # the lane's own copy: no bank conflicts
                                regs += [hi[e], lo[e]]
                            for j in range(4):
                                for half, v in enumerate(_halves(regs[j])):
                                    a[_a_pos(lane, j, half)] = v
                        d = a @ b_mat
                        if group_size:
                            grp = (c * 128 + 32 * p) // group_size
                            row = np.minimum(np.arange(8) + 16 * rb + 8 * h, n_out - 1)
                            d = d * np.tile(scales[row, grp], 2)[:, None]
                        acc[h] += d
        for lane in range(32):
            for i in range(4):
                h, e = divmod(i, 2)
                g, t = divmod(lane, 4)
                (r_hi, col), (r_lo, _) = _d_pos(lane, e), _d_pos(lane, e + 2)
                if col < m:
                    y[col, 16 * rb + 8 * h + g] = acc[h][r_hi, col] + acc[h][r_lo, col]
    y = y[:, :n_out]
    return y if group_size else y * scales[None, :]


@pytest.mark.parametrize("m,group_size", [(1, None), (3, None), (8, None), (2, 32), (5, 64), (1, 256)])
def test_emulated_kernel_equals_the_formula(m, group_size):
    rng = np.random.default_rng(10 + m)
    n, k = 24, 256
    codes = _codes(rng, n, k)
    cb = np.sort(rng.standard_normal(16)).astype(np.float32) / 16
    x = rng.standard_normal((m, k)).astype(np.float32)
    x_bits = qmv_tc._bf16_bits(x)
    xv = qmv_tc._bf16_value(x_bits).astype(np.float64)
    w = cb.astype(np.float64)[codes]
    if group_size:
        scales = rng.uniform(0.5, 1.5, (n, k // group_size)).astype(np.float32)
        ws = w * np.repeat(scales.astype(np.float64), group_size, axis=1)
    else:
        scales = rng.uniform(0.5, 1.5, n).astype(np.float32)
        ws = w * scales.astype(np.float64)[:, None]
    ref = xv @ ws.T
    got = emulate(x_bits, qmv_tc.repack(_words(codes)), n, scales.astype(np.float64), cb, group_size)
    mag = np.abs(xv) @ np.abs(ws).T
    assert np.all(np.abs(got - ref) <= 2.0**-16 * mag + 1e-12)
    assert np.max(np.abs(got - ref)) > 0  # bf16 hi + lo is not the float32 codebook: some residual shows


def test_launch_spec_and_split():
    spec = qmv_tc.launch_spec((1, 1, 4096), 4096, (4096,), None, mx.bfloat16)
    assert spec["threadgroup"] == (32, 8, 1) and spec["grid"][1:] == (8, 1)  # 256 row blocks: split 8 ways
    spec = qmv_tc.launch_spec((1, 4096), 128256, (128256,), None, mx.bfloat16)  # one warp per long row block
    assert spec["threadgroup"] == (32, 1, 8) and spec["grid"][0] == 32 * 528 and ("PF", 2) in spec["template"]
    spec = qmv_tc.launch_spec((1, 4096), 28672, (28672,), None, mx.bfloat16)  # split 4 ways: PF 1, 3 per SM
    assert spec["threadgroup"] == (32, 4, 2) and spec["grid"][0] == 32 * 396 and ("PF", 1) in spec["template"]
    assert qmv_tc.split_k(256, 1) == 1  # never more warps than chunks
    with pytest.raises(ValueError, match="in_features % 128"):
        qmv_tc.launch_spec((1, 100), 16, (16,), None, mx.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        qmv_tc.launch_spec((1, 128), 16, (16,), None, mx.float16)
    with pytest.raises(ValueError, match="scales must have shape"):
        qmv_tc.launch_spec((1, 128), 16, (8,), None, mx.bfloat16)
    spec = qmv_tc.launch_spec((2, 256), 48, (48,), None, mx.bfloat16, splits=(16, 32))
    assert spec["output_shapes"] == [(2, 16), (2, 16), (2, 16)]


def test_dispatch_modes_and_auto_rule():
    x1, x4 = mx.zeros((1, 1, 4096), mx.bfloat16), mx.zeros((4, 4096), mx.bfloat16)
    with qmv_tc.mode("0"):
        assert not qmv_tc.wanted(x4, 4, 28672)
    with qmv_tc.mode("1"):
        assert qmv_tc.wanted(x1, 4, 64) and not qmv_tc.wanted(x1, 3, 64)
        assert not qmv_tc.wanted(x1.astype(mx.float16), 4, 64)
        assert not qmv_tc.wanted(mx.zeros((1, 100), mx.bfloat16), 4, 64)
        assert not qmv_tc.wanted(mx.zeros((9, 4096), mx.bfloat16), 4, 64)  # prefill: the dense path
    with qmv_tc.mode("auto"):
        assert qmv_tc.wanted(x1, 4, 128256) and not qmv_tc.wanted(x1, 4, 28672)  # M = 1: heads, long rows
        assert qmv_tc.wanted(mx.zeros((1, 14336), mx.bfloat16), 4, 4096)
        assert qmv_tc.wanted(x4, 4, 28672) and not qmv_tc.wanted(mx.zeros((4, 896), mx.bfloat16), 4, 1152)
        assert qmv_tc.wanted(mx.zeros((8, 896), mx.bfloat16), 4, 1152)
        assert not qmv_tc.wanted(mx.zeros((8, 512), mx.bfloat16), 4, 1152)  # narrow: the residual would dominate
    with pytest.raises(ValueError, match="mode must be one of"):
        qmv_tc.set_mode("yes")


def test_render_names_and_bounds():
    a, b = qmv_tc.render(1), qmv_tc.render(1, 3)
    assert a[0] != b[0] and "__launch_bounds__(256, 3)" in b[1] and "__launch_bounds__" not in a[1]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in a[1]
    assert "out2" in qmv_tc.render(3)[2]


def test_packed_for_caches_per_array():
    class Owner:
        pass

    o, w = Owner(), mx.array(np.arange(16 * 16, dtype=np.uint32).reshape(16, 16))
    r1 = qmv_tc.packed_for(o, w)
    assert qmv_tc.packed_for(o, w) is r1
    assert qmv_tc.packed_for(o, mx.array(np.zeros((16, 16), np.uint32))) is not r1


def _gpu():
    return qmv.backend() == "cuda"


def tc_bound(x, w, s, k):
    """float32 accumulation (as tests/test_qmv.py) + the hi + lo residual (2^-16 |C|) + half a bf16 ulp."""
    mag = (np.abs(x) @ np.abs(w).T) * s
    ref = (x @ w.T) * s
    return ref, (k / 4 + 64) * 2.0**-24 * mag + 2.0**-16 * mag + 2.0**-8 * np.abs(ref)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 896), (48, 128), (6144, 4096)])
def test_gpu_against_float64(m, n, k):
    rng = np.random.default_rng(n + k + m)
    codes = _codes(rng, n, k)
    cb = np.sort(rng.standard_normal(16)).astype(np.float32) / math.sqrt(k)
    s = rng.uniform(0.5, 1.5, n).astype(np.float32)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(mx.bfloat16)
    rp = qmv_tc.repack(mx.array(_words(codes)))
    y = qmv_tc.launch(x, rp, n, mx.array(s), mx.array(cb))
    xv = np.array(x.astype(mx.float32)).astype(np.float64)
    ref, bound = tc_bound(xv, cb.astype(np.float64)[codes], s.astype(np.float64), k)
    err = np.abs(np.array(y.astype(mx.float32)).astype(np.float64) - ref)
    assert np.all(err <= bound), float(np.max(err / bound))


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("gs", [32, 64, 128, 256])
def test_gpu_group_scales_bias_splits(gs):
    rng = np.random.default_rng(gs)
    n, k, m = 320, 1024, 3
    codes = _codes(rng, n, k)
    cb = np.sort(rng.standard_normal(16)).astype(np.float32) / 32
    s = rng.uniform(0.5, 1.5, (n, k // gs)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    x = mx.array(rng.standard_normal((1, m, k)).astype(np.float32)).astype(mx.bfloat16)
    ys = qmv_tc.launch(x, qmv_tc.repack(mx.array(_words(codes))), n, mx.array(s), mx.array(cb),
                       mx.array(b).astype(mx.bfloat16), gs, splits=(64, 128))
    y = np.concatenate([np.array(v.astype(mx.float32)) for v in ys], axis=-1)[0].astype(np.float64)
    xv = np.array(x.astype(mx.float32))[0].astype(np.float64)
    w = cb.astype(np.float64)[codes] * np.repeat(s.astype(np.float64), gs, axis=1)
    ref, bound = tc_bound(xv, w, 1.0, k)
    bb = np.array(mx.array(b).astype(mx.bfloat16).astype(mx.float32)).astype(np.float64)
    assert np.all(np.abs(y - ref - bb) <= bound + 2.0**-8 * np.abs(bb)), float(np.max(np.abs(y - ref - bb) / bound))


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs MLX's CUDA backend")
def test_gpu_deterministic():
    rng = np.random.default_rng(5)
    rp = qmv_tc.repack(mx.array(_words(_codes(rng, 4096, 4096))))
    x = mx.array(rng.standard_normal((4, 4096)).astype(np.float32)).astype(mx.bfloat16)
    s, cb = rng.uniform(0.5, 1.5, 4096).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    args = (rp, 4096, mx.array(s), mx.array(cb))
    a, b = qmv_tc.launch(x, *args), qmv_tc.launch(x, *args)
    assert np.array_equal(np.array(a.view(mx.uint16)), np.array(b.view(mx.uint16)))


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("m", [1, 4])
def test_gpu_layer_takes_the_tensor_core_kernel(m, monkeypatch):
    import mlx.nn as nn

    from vqpipe.layers.qlinear import QuantizedLinear

    lin = nn.Linear(512, 640, bias=True)
    layer = QuantizedLinear.from_linear(lin, 4, "auto", seed=3)
    x = mx.random.normal((1, m, 512), key=mx.random.key(4)).astype(mx.bfloat16)
    calls = []
    real = qmv_tc.launch
    monkeypatch.setattr(qmv_tc, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    with qmv_tc.mode("1"):
        on = layer(x)
    with qmv_tc.mode("0"):
        off = layer(x)  # revision 6
    assert calls and "_qmv_tc_packed" in layer.__dict__ and "_qmv_tc_packed" not in layer.parameters()
    xr = np.array(layer.rotation.apply(x).astype(mx.float32)).reshape(m, 512).astype(np.float64)
    w = np.array(layer.codebook).astype(np.float64)[np.array(unpack(layer.packed, 4, 512))]
    s = np.array(layer.scales).astype(np.float64)
    ref, bound = tc_bound(xr, w, s, 512)
    bias = np.array(layer.bias.astype(mx.float32)).astype(np.float64)
    got = np.array(on.astype(mx.float32)).reshape(m, 640).astype(np.float64)
    assert np.all(np.abs(got - ref - bias) <= bound + 2.0**-7 * np.abs(bias))
    assert float(mx.max(mx.abs(on.astype(mx.float32) - off.astype(mx.float32)))) < 0.02 * float(mx.max(mx.abs(off)))


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs MLX's CUDA backend")
def test_gpu_generation_tensor_core_against_revision_6(tmp_path_factory, monkeypatch):
    from mlx_lm import load

    from test_qmv import _decode
    from vqpipe.quant.config import QuantizeConfig
    from vqpipe.quant.quantize import quantize_model
    from vqpipe.stages.download import fetch

    path = fetch("synth:tiny", tmp_path_factory.mktemp("qmvtc") / "tiny", seed=0)
    model, tok = load(str(path))
    config = QuantizeConfig(embeddings=False, dtype=mx.bfloat16, threads=1, calib_text="none", codes="scalar")
    quantize_model(model, config)  # bf16 activations into every linear
    calls = []
    real = qmv_tc.launch
    monkeypatch.setattr(qmv_tc, "launch", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    prompt = tok.encode("The rotation spreads the outliers over every coordinate, and the codebook")
    with qmv_tc.mode("1"):
        on = _decode(model, prompt, 8, True)
    assert calls and all(s[:-1] == (1, 1) for s in calls)  # decode steps (fused groups included), not prefill
    with qmv_tc.mode("0"):
        off = _decode(model, prompt, 8, True)
    same = 0
    while same < 8 and on[0][:same] == off[0][:same]:
        p_off = np.exp(off[1][same])
        assert float(np.sum(p_off * (off[1][same] - on[1][same]))) < 2e-2
        same += 1
    if on[0] != off[0]:  # only where the two best logits are within what the kernels can disagree by
        i = next(j for j in range(8) if on[0][j] != off[0][j])
        top2 = np.sort(off[1][i])[-2:]
        assert top2[1] - top2[0] <= 2 * np.abs(on[1][i] - off[1][i]).max()
