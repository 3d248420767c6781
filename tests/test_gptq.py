"""Calibrated quantization: GPTQ in the rotated basis, group scales, their state and reservoir round trip."""

import hashlib
import json
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from vqpipe import blas
from vqpipe.codec import gptq
from vqpipe.store import reservoir as R
from vqpipe.codec.bitpack import unpack
from vqpipe.layers.qlinear import QuantizedLinear, quantize_weight
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import quantize_model, quantized_layers, split_state
from vqpipe.codec.rotation import make_rotation

from test_reservoir import make_model

ARCH = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "tie_word_embeddings": False}
CALIB = mx.array(np.random.default_rng(3).integers(0, 256, (4, 16)), dtype=mx.int32)
SEED1 = QuantizeConfig(seed=1, dtype="float32", threads=1, calib_text="none")
TOKENS = mx.array([[1, 5, 9, 2, 77, 31, 4, 100]], dtype=mx.int32)


def anisotropic(din=128, dout=96, n=1024, seed=0):
    """A layer whose inputs have a few heavy channels (as real activations do) and a correlated rest."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0, 1.0, din))
    scale[:4] *= 20
    mix = np.eye(din) + 0.3 * rng.standard_normal((din, din)) / np.sqrt(din)
    x = (rng.standard_normal((n, din)) * scale) @ mix
    w = rng.standard_normal((dout, din)) * 0.05
    return w.astype(np.float32), x.astype(np.float32)


def output_error(layer, w, x):
    e = (w - np.array(layer.dequantized_weight())) @ x.T
    return float(np.sum(e * e) / np.sum((w @ x.T) ** 2))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group_size", [None, 32])
def test_gptq_beats_round_to_nearest_on_anisotropic_inputs(bits, group_size):
    w, x = anisotropic()
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = mx.array(w)
    h = mx.array(x.T @ x)
    rtn = QuantizedLinear.from_linear(lin, bits, "auto", 1, group_size=group_size)
    cal = QuantizedLinear.from_linear(lin, bits, "auto", 1, group_size=group_size, hessian=h)
    # Far below: error feedback moves the error off the heavy input channels.
    assert output_error(cal, w, x) < 0.5 * output_error(rtn, w, x)
    # ...at the price of a larger plain weight error (it is the output that is optimised).
    assert cal.squared_error > rtn.squared_error


def test_gptq_with_identity_moments_is_round_to_nearest():
    w, _ = anisotropic()
    r = make_rotation("auto", w.shape[1], 2)
    wr = np.array(r.apply(mx.array(w)))
    levels = np.array([-1.5, -0.5, 0.5, 1.5], dtype=np.float32)
    idx, steps = gptq.gptq(wr, None, levels, 32)
    t = wr / np.repeat(steps, 32, axis=1)
    assert np.array_equal(idx, np.searchsorted(gptq.boundaries(levels), t))


def test_refit_steps_is_least_squares():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 16)).astype(np.float32)
    c = np.sign(rng.standard_normal((3, 16))).astype(np.float32)
    a = rng.standard_normal((16, 16))
    h = (a @ a.T + np.eye(16)).astype(np.float32)
    s = gptq.refit_steps(w, c, 4, h)
    for o in range(3):
        z = np.zeros((16, 4))
        for g in range(4):
            z[g * 4 : g * 4 + 4, g] = c[o, g * 4 : g * 4 + 4]
        want = np.linalg.solve(z.T @ h @ z, z.T @ h @ w[o])
        assert np.allclose(s[o], want, rtol=1e-4, atol=1e-5)


# Hashes of (packed, scales, codebook) from vqpipe before calibration and group scales existed.
GOLDEN = {(2, "hadamard"): "4b24d366705c4a9a", (3, "kron"): "a116ed7e5f2a05b9", (4, "hadamard"): "6b3eaa41a9ab498a",
          (4, "kron"): "0466c7bcacd2dfb2", (4, "none"): "e43321805a6998bd"}


@pytest.mark.parametrize("bits,kind", sorted(GOLDEN))
def test_data_free_path_unchanged(bits, kind):
    w = mx.array((np.random.default_rng(7).standard_normal((48, 320)) * 0.03).astype(np.float32))
    d = 256 if kind == "hadamard" else 320
    packed, scales, cb, _ = quantize_weight(w[:, :d], bits, make_rotation(kind, d, 5))
    digest = hashlib.sha256(np.array(packed).tobytes() + np.array(scales).tobytes() + np.array(cb).tobytes())
    assert digest.hexdigest()[:16] == GOLDEN[(bits, kind)]


def calibrated(group_size=16, bits=3, seed=0):
    model, config = make_model(ARCH, seed=seed)
    settings = replace(SEED1, bits=bits, group_size=group_size, embeddings=False)
    records = quantize_model(model, settings, calibration=CALIB)
    return model, config, records


def test_calibrated_model_is_deterministic():
    a, _, ra = calibrated()
    b, _, rb = calibrated()
    ma, xa, _ = split_state(a)
    mb, xb, _ = split_state(b)
    assert ma == mb and xa.keys() == xb.keys()
    for k in xa:
        assert np.array(xa[k]).tobytes() == np.array(xb[k]).tobytes(), k
    assert all(r["calibrated"] for r in ra)
    # q/k/v read one activation and share its moments; so do gate/up.
    keys = {r["name"].split(".")[-1]: r["hessian"] for r in ra if r["name"].startswith("model.layers.0.")}
    assert keys["q_proj"] == keys["k_proj"] == keys["v_proj"] != keys["o_proj"]
    assert keys["gate_proj"] == keys["up_proj"] != keys["down_proj"]
    # Not o_proj's: its freed input's id was once reused for gate/up's input, which then took its H.
    assert keys["gate_proj"] == "model.layers.0.mlp.gate_proj" and keys["o_proj"] == "model.layers.0.self_attn.o_proj"


def test_calibration_lowers_logit_error():
    source, _ = make_model(ARCH)
    ref = source(CALIB).astype(mx.float32)
    errs = {}
    for calib in (None, CALIB):
        model, _ = make_model(ARCH)
        quantize_model(model, replace(SEED1, bits=2, group_size=16), calibration=calib)
        errs[calib is None] = mx.mean((model(CALIB).astype(mx.float32) - ref) ** 2).item()
    assert errs[False] < errs[True]  # measured on the calibration tokens themselves


def test_group_state_round_trip_and_reservoir(tmp_path):
    model, config, _ = calibrated()
    want = np.array(model(TOKENS))
    layers = quantized_layers(model)
    layer = layers["model.layers.0.mlp.down_proj"]
    assert layer.group_size == 16 and layer.scales.shape == (64, 128 // 16) and layer.scales.dtype == mx.float16
    meta, arrays = layer.to_state()
    again = QuantizedLinear.from_state(json.loads(json.dumps(meta)), arrays)
    x = mx.random.normal((3, 128))
    assert np.array_equal(np.array(again(x)), np.array(layer(x)))
    # The dense forward matches the documented contract.
    q = np.array(layer.codebook)[np.array(unpack(layer.packed, 3, 128))]
    xr = np.array(layer.rotation.apply(x))
    s = np.repeat(np.array(layer.scales, dtype=np.float32), 16, axis=1)
    assert np.allclose(xr @ (q * s).T, np.array(layer(x)), atol=1e-4)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for persist in (True, False):
        path = tmp_path / f"p{persist}" / R.FILE_NAME
        path.parent.mkdir()
        (path.parent / "config.json").write_text(json.dumps(config))
        R.save_reservoir(model, path, persist_rotation=persist)
        assert R.read_header(path)["format_version"] == 2
        loaded = R.load_reservoir(path)
        assert np.array(loaded(TOKENS)).tobytes() == want.tobytes()


def test_per_row_reservoir_stays_version_1(tmp_path):
    """Scalar codes with per-row scales: the first format's file, as readers before groups read it."""
    model, config = make_model(ARCH)
    quantize_model(model, replace(SEED1, codes="scalar"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / R.FILE_NAME
    R.save_reservoir(model, path)
    assert R.read_header(path)["format_version"] == 1


def test_bad_group_size():
    model, _ = make_model(ARCH)
    with pytest.raises(ValueError, match="group size 48"):
        quantize_model(model, replace(SEED1, group_size=48))


def test_shared_rotation_factorises_once(monkeypatch):
    """q/k/v with one rotation and one H: one Cholesky, and the same codes as factorising apiece."""
    calls = []
    real = gptq.ldl_factor
    monkeypatch.setattr(gptq, "ldl_factor", lambda h, d: calls.append(1) or real(h, d))
    w, x = anisotropic()
    h = mx.array(x.T @ x)
    r = make_rotation("auto", w.shape[1], 4)
    layers = []
    for i in range(3):
        lin = nn.Linear(w.shape[1], 32, bias=False)
        lin.weight = mx.array(w[i * 32 : (i + 1) * 32])
        layers.append(QuantizedLinear.from_linear(lin, 3, r, group_size=32, hessian=h))
    assert len(calls) == 1
    alone = nn.Linear(w.shape[1], 32, bias=False)
    alone.weight = mx.array(w[32:64])
    again = QuantizedLinear.from_linear(alone, 3, r, group_size=32, hessian=mx.array(x.T @ x))
    assert len(calls) == 2
    assert np.array_equal(np.array(again.packed), np.array(layers[1].packed))


def _ldl_check(h, n, damped):
    """(I + N) is unit upper triangular and diagonalises the damped H: (I + N)^-1 A (I + N)^-T = D."""
    d = h.shape[0]
    assert np.array_equal(n, np.triu(n, 1))
    m = np.linalg.inv(np.eye(d) + n.astype(np.float64))
    dd = m @ damped @ m.T
    assert np.all(np.diag(dd) > 0)
    off = dd - np.diag(np.diag(dd))
    assert np.abs(off).max() < 1e-4 * np.diag(dd).max()


def test_ldl_factor_diagonalises_the_damped_moments():
    _, x = anisotropic(din=96, n=400)
    h = x.T @ x
    _ldl_check(h, gptq.ldl_factor(h, 0.01), h.astype(np.float64) + 0.01 * np.mean(np.diag(h)) * np.eye(96))


def push_gptq(w, h, levels):
    """GPTQ as Frantar et al. write it (float64, one scale per row set from the row RMS): each
    column's rounding error pushed through its row of U = chol((H + damp)^-1), upper."""
    d = w.shape[1]
    a = h + 0.01 * np.mean(np.diag(h)) * np.eye(d)
    u = np.linalg.cholesky(np.linalg.inv(a)).T
    w = w.astype(np.float64).copy()
    step = np.sqrt(np.mean(w * w, axis=1))
    bounds = gptq.boundaries(levels)
    idx = np.empty(w.shape, dtype=np.uint8)
    for i in range(d):
        idx[:, i] = np.searchsorted(bounds, w[:, i] / step)
        err = (w[:, i] - step * levels[idx[:, i]]) / u[i, i]
        w[:, i + 1 :] -= np.outer(err, u[i, i + 1 :])
    return idx


def test_ldl_form_is_gptq():
    """The LDL-form recursion (no inverse) picks GPTQ's codes: the same algorithm in exact
    arithmetic, so float32 against float64 differ only where a value sits on a boundary."""
    w, x = anisotropic(din=128, dout=96, seed=3)
    h = (x.T @ x).astype(np.float64)
    levels = np.array([-1.5, -0.5, 0.5, 1.5], dtype=np.float32)
    want = push_gptq(w, h, levels.astype(np.float64))
    got, _ = gptq.gptq(w, gptq.ldl_factor(h.astype(np.float32)), levels, block=32)
    assert np.mean(got != want) < 1e-3
    assert np.mean(got != gptq.gptq(w, None, levels)[0]) > 0.1  # not round to nearest


def test_gptq_and_refit_do_not_depend_on_the_row_chunk():
    """Rows are independent: the chunked loops (cache-sized working sets) give the same bytes."""
    w, x = anisotropic(din=128, dout=301)
    r = make_rotation("auto", 128, 1)
    wr = np.array(r.apply(mx.array(w)))
    h = np.array(gptq.rotate_hessian(mx.array(x.T @ x), r), dtype=np.float32)
    n = gptq.ldl_factor(h)
    levels = np.array([-1.5, -0.5, 0.5, 1.5], dtype=np.float32)
    exact = blas.width_invariant()
    for gs in (None, 32):
        whole = gptq.gptq(wr, n, levels, gs, rows=10**6)
        for rows in (2, 7, 100, 128):  # 100: the last row joins the chunk before
            part = gptq.gptq(wr, n, levels, gs, rows=rows)
            assert np.array_equal(whole[0], part[0]) and np.array_equal(whole[1], part[1])
        c = levels[whole[0]]
        s = gptq.refit_steps(wr, c, gs, h, chunk=10**6)
        for chunk in (2, 13, 100):
            got = gptq.refit_steps(wr, c, gs, h, chunk=chunk)
            if exact:
                assert np.array_equal(s, got)
            else:  # its products' rounding depends on the chunk's width here (blas.width_invariant)
                assert np.abs(s - got).max() <= 1e-5 * np.abs(s).max()


def test_ldl_factor_dead_input():
    _, x = anisotropic(din=96)
    h = x.T @ x
    h[5], h[:, 5] = 0, 0  # a dead input
    a = h.astype(np.float64) + np.diag(np.where(np.diag(h) <= 0, 1.0, 0.0))
    a += 0.01 * np.mean(np.diag(h)) * np.eye(96)  # the mean over every input, dead ones as 0
    _ldl_check(h, gptq.ldl_factor(h), a)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_code_lookup_is_searchsorted(bits):
    from vqpipe.codec.codebook import boundaries, codebook

    bounds = boundaries(codebook(bits, 896)).astype(np.float32)
    rng = np.random.default_rng(bits)
    ties = np.concatenate([bounds, np.nextafter(bounds, np.float32(np.inf)), np.nextafter(bounds, np.float32(-np.inf))])
    t = np.concatenate([rng.standard_normal(20000).astype(np.float32) * 1.5, ties,
                        np.float32([0, -0.0, 1e30, -1e30, np.inf, -np.inf, 6e-39])])
    t = np.concatenate([t, t * np.float32(1 + 2 ** -23)])
    got = gptq._codes(t, gptq._code_table(bounds))
    assert np.array_equal(got, np.searchsorted(bounds, t))


def test_gptq_rejects_non_finite_weights():
    w = np.ones((4, 16), dtype=np.float32)
    w[1, 3] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        gptq.gptq(w, None, np.float32([-1, 1]))


def test_gram_is_symmetric_and_xtx():
    from vqpipe.quant.calibrate import gram

    x = mx.random.normal((300, 40), key=mx.random.key(0)) * mx.arange(1, 41)
    g, want = gram(x), np.array(x).astype(np.float64).T @ np.array(x).astype(np.float64)
    assert g.dtype == np.float32 and np.array_equal(g, g.T)
    assert np.abs(g - want).max() <= 1e-5 * np.abs(want).max()


def test_rotated_moments_need_their_rotation():
    x = mx.random.normal((64, 32), key=mx.random.key(1))
    r, other = make_rotation("auto", 32, 3), make_rotation("auto", 32, 4)
    xr = r.apply(x)
    h = gptq.Rotated(xr.T @ xr, r)
    want = np.array(gptq.rotate_hessian(x.T @ x, r))
    assert np.abs(np.array(gptq.rotate_hessian(h, r)) - want).max() <= 1e-5 * np.abs(want).max()
    with pytest.raises(ValueError, match="cannot calibrate"):
        gptq.rotate_hessian(h, other)
