"""Calibration of a tied embedding/head, and full-precision (non-sequential) second moments."""

import json
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from vqpipe.codec import gptq
from vqpipe.store import reservoir as R
from vqpipe.stages import bench_quality as q
from vqpipe.quant.calibrate import tied_head
from vqpipe.layers.qlinear import QuantizedEmbedding, QuantizedLinear
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import quantize_model

from test_reservoir import make_model

TIED = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "tie_word_embeddings": True}
CALIB = mx.array(np.random.default_rng(5).integers(0, 256, (4, 32)), dtype=mx.int32)
GROUPED = QuantizeConfig(3, seed=1, group_size=16, dtype="float32", threads=1, calib_text="none")
TOKENS = mx.array([[1, 5, 9, 2, 77, 31, 4, 100]], dtype=mx.int32)
LDL_FACTOR = gptq.ldl_factor



def assert_round_trip(model, config, tmp_path, format_version):
    """Pack ``model`` in both persist_rotation modes: the header's version, bit-exact logits."""
    want = np.array(model(TOKENS))
    for persist in (True, False):
        path = tmp_path / f"p{persist}" / R.FILE_NAME
        path.parent.mkdir()
        (path.parent / "config.json").write_text(json.dumps(config))
        R.save_reservoir(model, path, persist_rotation=persist)
        assert R.read_header(path)["format_version"] == format_version
        assert np.array(R.load_reservoir(path)(TOKENS)).tobytes() == want.tobytes()

def test_tied_head_detection():
    tied, _ = make_model(TIED)
    untied, _ = make_model({**TIED, "tie_word_embeddings": False})
    assert tied_head(tied) and not tied_head(untied)


def test_tied_head_is_calibrated_with_group_scales(tmp_path):
    model, config = make_model(TIED)
    records = quantize_model(model, GROUPED, calibration=CALIB)
    rec = next(r for r in records if r["kind"] == "embedding")
    assert rec["calibrated"] and rec["hessian"] == "final norm" and rec["group_size"] == 16
    emb = model.model.embed_tokens
    assert isinstance(emb, QuantizedEmbedding) and emb.scales.shape == (256, 64 // 16)
    # The lookup serves the same codes and scales as the head.
    rows = np.array(emb(mx.array([3, 200])))
    assert np.allclose(rows, np.array(emb.dequantized_weight())[[3, 200]], atol=1e-6)
    assert_round_trip(model, config, tmp_path, format_version=2)


def test_calibrated_tied_head_lowers_head_error():
    source, _ = make_model(TIED)
    w = np.array(source.model.embed_tokens.weight, dtype=np.float32)
    x = np.array(source.model(CALIB).reshape(-1, 64), dtype=np.float32)  # the final norm's output
    model, _ = make_model(TIED)
    # Full-precision moments: the head's H is exactly x^T x of the source's final norm.
    quantize_model(model, replace(GROUPED, bits=2), calibration=CALIB)
    cal = np.array(model.model.embed_tokens.dequantized_weight())
    lin = nn.Linear(64, 256, bias=False)
    lin.weight = mx.array(w)
    free = np.array(QuantizedLinear.from_linear(lin, 2, "auto", 1, group_size=16).dequantized_weight())

    def err(w_hat):
        return float(np.sum(((w - w_hat) @ x.T) ** 2))

    assert err(cal) < 0.8 * err(free)


def _moments(monkeypatch, bits, sequential):
    seen = []
    monkeypatch.setattr(gptq, "ldl_factor", lambda h, d: seen.append(np.array(h)) or LDL_FACTOR(h, d))
    model, _ = make_model(TIED)
    quantize_model(model, replace(GROUPED, bits=bits, sequential=sequential), calibration=CALIB)
    return seen


def test_full_precision_moments_do_not_depend_on_bits(monkeypatch):
    a, b = _moments(monkeypatch, 2, False), _moments(monkeypatch, 4, False)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    # Sequential: block 1 onwards sees the quantized blocks before it, so the bit width shows.
    c, d = _moments(monkeypatch, 2, True), _moments(monkeypatch, 4, True)
    assert np.array_equal(c[0], d[0]) and not all(np.array_equal(x, y) for x, y in zip(c, d))


def test_affine_arm_quantizes_the_embedding_when_asked(tiny_source):
    dense, _, bpw_dense = q.affine_arm(tiny_source, 4, 64)
    model, _, bpw = q.affine_arm(tiny_source, 4, 64, embeddings=True)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert "embed_tokens" in bpw_dense["unquantized_params"] and "embed_tokens" not in bpw["unquantized_params"]
    assert bpw["bpw"] == pytest.approx(4.5) and bpw["bpw_matrices"] == pytest.approx(4.5)
    # A dense bf16 embedding counts 16 bits a weight over all matrices.
    assert bpw_dense["bpw_matrices"] > 4.5
    ids = mx.array([[5, 17, 300, 42, 7, 99, 1000, 3]])
    want = model(ids)
    got = q.dense_copy(model)(ids)
    assert isinstance(model.model.embed_tokens, nn.Embedding)
    assert mx.abs(got - want).max().item() < 1e-3 * mx.abs(want).max().item()



def test_stored_moments_quantize_as_in_process():
    # In process the moments are summed from the rotated activations (calibrate.collect); stored
    # ones are rotated afterwards (R H R^T): the same moments to float32 rounding, so the same
    # quantizer up to codes at a rounding tie and scales an ulp off.
    from vqpipe.quant.calibrate import collect, decoder
    from vqpipe.quant.quantize import layer_rotation, split_state
    from vqpipe.quant.calibrate import full_precision_moments

    inproc, _ = make_model(TIED)
    rin = quantize_model(inproc, GROUPED, calibration=CALIB)
    source, _ = make_model(TIED)
    names, sums = full_precision_moments(source, CALIB)
    assert names["model.embed_tokens"] == "final norm" and len(set(names.values())) == 2 * 4 + 1
    block = [n for n in names if n.startswith("model.layers.0.")]
    layer = decoder(source).layers[0]
    x = decoder(source).embed_tokens(CALIB).astype(mx.float32)
    rotated, _ = collect(source, block, lambda b: layer(b, "causal", cache=None), [x],
                         lambda name, dim: layer_rotation("auto", 1, name, dim))
    for name in block:
        key, h = rotated[name]
        assert isinstance(h, gptq.Rotated) and key == names[name]
        want = np.array(gptq.rotate_hessian(sums[key], h.rotation))
        assert np.abs(np.array(h.h) - want).max() <= 1e-5 * np.abs(want).max(), name
    stored, _ = make_model(TIED)
    rst = quantize_model(stored, GROUPED, moments={n: (k, sums[k]) for n, k in names.items()})
    assert all(r["calibrated"] for r in rst)
    (ma, xa, pa), (mb, xb, pb) = split_state(inproc), split_state(stored)
    assert ma == mb and xa.keys() == xb.keys() and pa.keys() == pb.keys()
    for a, b in zip(rin, rst):
        assert a["name"] == b["name"] and a["squared_error"] == pytest.approx(b["squared_error"], rel=1e-3)
    same = [np.mean(np.array(xa[k]) == np.array(xb[k])) for k in xa if k.endswith(".packed")]
    assert min(same) > 0.99 and np.mean(same) > 0.999, same


def test_calibrate_stage_feeds_quantize(tiny_source, tmp_path):
    from vqpipe.stages import calibrate
    from vqpipe.stages import quantize
    from vqpipe.store import calibration

    assert calibrate.main(["--source", str(tiny_source), "--out", str(tmp_path / "m"), "--calib-windows", "2",
                         "--calib-length", "16"]) == 0
    info = quantize.run(tiny_source, tmp_path / "q", 4, group_size=64, moments=tmp_path / "m",
                        progress=lambda *_: None)
    assert info["calibration"]["sequential"] is False and info["calibration"]["windows"] == 2
    head = next(r for r in info["records"] if r["kind"] == "embedding")
    assert head["hessian"] == "final norm" and head["calibrated"]
    with pytest.raises(ValueError, match="choose one"):
        quantize.run(tiny_source, tmp_path / "q2", 4, calibration="text", moments=tmp_path / "m")
    (tmp_path / "m" / "calibrate.safetensors").write_bytes(b"broken")
    with pytest.raises(ValueError):
        calibration.load(tmp_path / "m")


def test_quantize_cli_full_precision_moments(tiny_source, tmp_path):
    from vqpipe.stages import quantize

    out = tmp_path / "q"
    assert quantize.main(["--source", str(tiny_source), "--out", str(out), "--bits", "3", "--calibration", "text",
                          "--calib-windows", "1", "--calib-length", "8", "--no-sequential"]) == 0
    info = json.loads((out / "quantized.json").read_text())
    assert info["calibration"]["sequential"] is False and all(r["calibrated"] for r in info["records"])


def test_bench_quality_counts_group_scales_as_stored(tiny_source, tmp_path):
    from vqpipe.stages import quantize

    quantize.run(tiny_source, tmp_path / "q", 4, group_size=64, calibration="none", progress=lambda *_: None)
    model, _, bpw = q.vqpipe_arm(tiny_source, 4, "auto", 0, tmp_path / "q")
    # Linears: a float16 scale per 64 weights (0.25 bits), even though the evaluation copy is
    # float32; the data-free embedding: a float32 scale per row.
    layers = [m for _, m in model.named_modules() if hasattr(m, "to_state")]
    want = sum(m.out_features * (m.in_features // 64 * 16 if not isinstance(m, QuantizedEmbedding) else 32)
               for m in layers) / sum(m.in_features * m.out_features for m in layers)
    assert any(isinstance(m, QuantizedEmbedding) for m in layers)
    assert bpw["parts_bpw"]["scales"] == pytest.approx(want) and want < 0.25
