"""Trellis codes as a quantizer mode (issue 34): block LDLQ, the layer, the model, the reservoir."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import load

from vqpipe.codec import gptq, ldlq, trellis
from vqpipe.kernels import ext
from vqpipe.layers.qlinear import QuantizedLinear, trellis_fits
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import quantize_model
from vqpipe.stages import pack, quantize, show, validate
from vqpipe.store import reservoir as R


def test_ldlq_without_moments_is_plain_viterbi():
    w = np.random.default_rng(0).standard_normal((64, 24)).astype(np.float32)
    packed, scales, c = ldlq.ldlq(w, 2)
    step = np.sqrt(np.mean(w * w, axis=1))[:, None]
    for b0 in range(0, 24, trellis.GROUP):
        codes, values = trellis.quantize(w[:, b0:b0 + 8] / step, 2)
        assert np.array_equal(packed[:, b0 // 8 * 16:(b0 // 8 + 1) * 16], codes)
        assert np.array_equal(c[:, b0:b0 + 8], values)
    assert np.allclose(scales, gptq.refit_steps(w, c)[:, 0])
    assert np.array_equal(trellis.decode(packed, 64, 24, 2), c)


def test_ldlq_moments_lower_the_output_error():
    rng = np.random.default_rng(1)
    d, rows = 64, 64
    mix = rng.standard_normal((d, d)).astype(np.float32) * 0.3 + np.eye(d, dtype=np.float32)
    x = rng.standard_normal((512, d)).astype(np.float32) @ mix  # correlated inputs
    h = x.T @ x
    n = gptq.ldl_factor(h)
    hd = h.copy()
    np.fill_diagonal(hd, hd.diagonal() + np.float32(gptq.DAMP * np.mean(np.diag(h))))
    w = rng.standard_normal((rows, d)).astype(np.float32)

    def out_err(c, s):
        e = w - s[:, None] * c
        return float(np.einsum("ij,ij->", e @ h, e))

    _, s0, c0 = ldlq.ldlq(w, 2)
    _, s1, c1 = ldlq.ldlq(w, 2, hd, ldlq.block_feedback(n))
    assert out_err(c1, s1) < 0.8 * out_err(c0, s0)


def test_trellis_fits():
    assert trellis_fits(2, 64, 24) and trellis_fits(5, 32, 8)
    assert not trellis_fits(6, 64, 24) and not trellis_fits(2, 48, 24) and not trellis_fits(2, 64, 20)
    assert not trellis_fits(2, 64, 24, group_size=8)


def test_config_codes():
    assert QuantizeConfig().codes == "trellis"
    with pytest.raises(ValueError, match="unknown codes"):
        QuantizeConfig(codes="e8p")
    assert QuantizeConfig(group_size=64).codes == "trellis"  # group scales: every layer scalar (trellis_fits)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_layer_forward_is_the_dense_reconstructions(bits, dtype):
    mx.random.seed(bits)
    lin = nn.Linear(72, 96, bias=True)
    layer = QuantizedLinear.from_linear(lin, bits, "auto", 0, codes="trellis")
    assert layer.codes == "trellis" and layer.packed.shape == (3, 72 // 8 * 8 * bits)
    assert np.array_equal(np.array(layer.trellis_values()), trellis.decode(np.array(layer.packed), 96, 72, bits))
    x = mx.random.normal((4, 72)).astype(dtype)
    y_ext = layer(x)
    with ext.using(False):
        y_dense = layer(x)
    ref = x.astype(mx.float32) @ layer.dequantized_weight().T + lin.bias
    tol = 1e-4 if dtype == mx.float32 else 5e-2
    assert y_ext.dtype == y_dense.dtype == dtype
    assert mx.allclose(y_ext.astype(mx.float32), ref, atol=tol, rtol=tol).item()
    assert mx.allclose(y_dense.astype(mx.float32), ref, atol=tol, rtol=tol).item()
    w = np.array(lin.weight)
    assert np.isclose(np.sum((w - np.array(layer.dequantized_weight())) ** 2), layer.squared_error, rtol=1e-3)


def test_unknown_codes_rejected():
    with pytest.raises(ValueError, match="unknown codes"):
        QuantizedLinear.from_linear(nn.Linear(8, 32), 2, codes="e8p")
    with pytest.raises(ValueError, match="cannot take trellis"):
        QuantizedLinear.from_linear(nn.Linear(8, 48), 2, codes="trellis")


def _greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1]).item()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def trellis_model(tiny_llama_source):
    model, _ = load(str(tiny_llama_source))
    records = quantize_model(model, QuantizeConfig(bits=2, calib_text="none", codes="trellis", threads=2))
    return model, records


def test_group_scales_keep_every_layer_scalar(tiny_llama_source):
    """The default codes are trellis; a group size (which trellis codes cannot carry) makes every
    linear layer scalar, with its group scales (a data-free embedding has per-row scales: trellis)."""
    model, _ = load(str(tiny_llama_source))
    records = quantize_model(model, QuantizeConfig(bits=3, calib_text="none", group_size=32, threads=2))
    assert {r["codes"] for r in records if r["kind"] == "linear"} == {"scalar"}
    assert {r["codes"] for r in records if r["kind"] == "embedding"} == {"trellis"}
    assert all(m.group_size == 32 for m in model.modules() if type(m) is QuantizedLinear)


def test_model_greedy_tokens_ext_equal_dense(trellis_model):
    from vqpipe.quant import recipe

    model, records = trellis_model
    per_layer = [m.to_state()[1] for m in model.modules() if isinstance(m, QuantizedLinear)]
    rest = sum(v.nbytes * 8 for a in per_layer for k, v in a.items() if k not in ("bias", "codebook"))
    assert recipe.model_bits(model)[0] == rest + 1024 * 32  # one trellis table per model
    assert {r["codes"] for r in records} == {"trellis"}  # every tiny-llama matrix tiles, the embedding too
    prompt = [1, 17, 300, 42, 7]
    # the cached decode runs one token a step: the ext mat-vec at M = 1 against the dense path
    fast = _greedy(model, prompt, 8)
    with ext.using(False):
        dense = _greedy(model, prompt, 8)
    assert fast == dense
    x = mx.array([prompt])
    with ext.using(False):
        full = model(x)
    assert mx.allclose(model(x[:, :1]), full[:, :1], atol=1e-3, rtol=1e-3).item()


def test_reservoir_round_trip_and_inspect(trellis_model, tmp_path, capsys):
    model, _ = trellis_model
    path = tmp_path / "model.vqres"
    R.save_reservoir(model, path)
    assert R.read_header(path)["format_version"] == 5
    header, summary = show.summary(path)
    assert summary["codes"] == {"trellis": len(header["layers"])}
    assert "codes       trellis" in show.render(header, summary, show_layers=True)
    meta = next(iter(header["layers"].values()))
    assert meta["codes"] == {"kind": "trellis", "L": 10, "code": "1mad", "scale": trellis.SCALE, "tile": [32, 8]}


def test_scalar_reservoir_version_unchanged(tiny_llama_source, tmp_path):
    model, _ = load(str(tiny_llama_source))
    quantize_model(model, QuantizeConfig(bits=2, calib_text="none", budget="none", threads=2, codes="scalar"))
    path = tmp_path / "model.vqres"
    R.save_reservoir(model, path)
    header = R.read_header(path)
    assert header["format_version"] == 1 and not any("codes" in m for m in header["layers"].values())
    assert show.summary(path)[1]["codes"] == {"scalar": len(header["layers"])}


@pytest.fixture(scope="module")
def trellis_artifact(tiny_llama_source, tmp_path_factory):
    root = tmp_path_factory.mktemp("trellis")
    out = root / "quantized"
    # qr rotations: the persist_rotation modes differ (a regenerated matrix in "off")
    quantize.run(tiny_llama_source, out, bits=2, rotation="qr", calibration="none", codes="trellis",
                 progress=lambda *_: None)
    packed = {}
    for mode in ("on", "off"):
        packed[mode] = root / f"persist-{mode}"
        pack.run(out, packed[mode], mode == "on", progress=lambda *_: None)
    return out, packed


@pytest.mark.parametrize("mode", ["on", "off"])
def test_validate_bit_exact(trellis_artifact, tmp_path, mode):
    out, packed = trellis_artifact
    assert json.loads((out / "quantized.json").read_text())["codes"] == "trellis"
    verdict = tmp_path / "verdict.json"
    assert validate.main(["--reservoir", str(packed[mode]), "--reference", str(out), "--out", str(verdict),
                          "--model", "tiny-llama", "--variant", "b2-trellis", "--persist-rotation", mode]) == 0
    assert R.read_header(packed[mode] / R.FILE_NAME)["format_version"] == 5


def test_malformed_codes_rejected(trellis_model, tmp_path):
    model, _ = trellis_model
    path = tmp_path / "model.vqres"
    R.save_reservoir(model, path)
    data = bytearray(path.read_bytes())
    from test_reservoir import rewrite_header

    def bad(h):
        next(iter(h["layers"].values()))["codes"]["code"] = "3inst"

    path.write_bytes(rewrite_header(data, bad))
    with pytest.raises(R.ReservoirError, match="codes"):
        R.read_header(path)


def test_recipe_tables_take_the_trellis_distortion():
    from vqpipe.codec.codebook import distortion
    from vqpipe.codec.rotation import make_rotation
    from vqpipe.quant import recipe

    r = make_rotation("hadamard", 64, 0)
    scalar = recipe.layer_table((96, 64), [2, 3, 6], None, r, 1.0)
    tr = recipe.layer_table((96, 64), [2, 3, 6], None, r, 1.0, "trellis")
    assert tr[2][1] == distortion(2, 64, "trellis") < scalar[2][1] and tr[6] == scalar[6]  # 6 bits: scalar
    assert tr[2][0] == 96 * 64 * 2 + 96 * 32 + 64 * 32  # codes, scales, signs (the table: once per model)
    odd = recipe.layer_table((48, 64), [2], None, r, 1.0, "trellis")  # 48 rows do not tile
    assert odd[2][1] == distortion(2, 64)
