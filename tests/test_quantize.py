import json
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import generate
from mlx_lm.utils import load

from vqpipe.layers.qlinear import QuantizedEmbedding, QuantizedLinear
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import quantize_model, quantized_layers
from vqpipe.stages.quantize import main, run
from vqpipe.store.quantized import load_quantized

DATA_FREE = QuantizeConfig(dtype="float32", threads=1, calib_text="none")


def _logits(model, tokens):
    out = model(mx.array(tokens)[None]).astype(mx.float32)
    mx.eval(out)
    return np.array(out[0])


@pytest.mark.parametrize("fixture", ["tiny_source", "tiny_llama_source", "tiny_4bit_source"])
def test_every_linear_becomes_quantized(fixture, request):
    src = request.getfixturevalue(fixture)
    model, tok = load(str(src))
    n_linear = sum(isinstance(m, (nn.Linear, nn.QuantizedLinear)) for _, m in model.named_modules())
    tokens = tok.encode("the rotation spreads the outliers")
    if fixture == "tiny_4bit_source":
        ref_model, _ = load(str(src))
    else:
        ref_model = model
    ref = _logits(ref_model, tokens)
    records = quantize_model(model, replace(DATA_FREE, embeddings=False))  # the embedding: test_quantized_embeddings
    layers = quantized_layers(model)
    assert len(layers) == len(records) == n_linear
    assert not any(isinstance(m, (nn.Linear, nn.QuantizedLinear, nn.QuantizedEmbedding))
                   for _, m in model.named_modules())
    assert all(r["rel_mse"] < 0.02 for r in records), records
    # 4-bit with rotation stays near the source logits (the synthetic models are more sensitive
    # than trained ones: ~0.4 relative error here); a broken layer or rotation gives >= 1.
    got = _logits(model, tokens)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < 0.7, rel
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.25


def test_rotation_kinds_and_error_ordering(tiny_source):
    errors = {}
    for rotation in ("auto", "kron", "none"):
        model, _ = load(str(tiny_source))
        records = quantize_model(model, replace(DATA_FREE, bits=3, rotation=rotation))
        kinds = {r["rotation"] for r in records}
        errors[rotation] = np.mean([r["rel_mse"] for r in records])
        if rotation == "auto":
            assert kinds == {"hadamard", "kron"}  # 4864 = 19 * 256 is not a Hadamard size
        else:
            assert kinds == {rotation}
    # The synthetic weights have outlier channels: rotating must beat the unrotated codebook.
    assert errors["auto"] < 0.8 * errors["none"], errors
    assert errors["kron"] < 0.8 * errors["none"], errors


def test_measured_error_matches_reconstruction(tiny_source):
    model, _ = load(str(tiny_source))
    weight = model.model.layers[0].mlp.down_proj.weight.astype(mx.float32)
    mx.eval(weight)
    layer = QuantizedLinear.from_linear(model.model.layers[0].mlp.down_proj, 2, "auto", seed=3)
    err = mx.sum((layer.dequantized_weight() - weight) ** 2).item()
    assert layer.squared_error == pytest.approx(err, rel=1e-3)
    x = mx.random.normal((3, weight.shape[1]), key=mx.random.key(0))
    assert np.allclose(np.array(layer(x)), np.array(x @ layer.dequantized_weight().T), atol=1e-3)


def test_no_dense_weight_resident(tiny_source):
    model, _ = load(str(tiny_source))
    quantize_model(model, DATA_FREE)
    layer = model.model.layers[0].mlp.down_proj
    names = set(dict(layer.parameters()))
    assert names == {"packed", "scales", "codebook"}
    assert layer.packed.dtype == mx.uint32
    assert layer.packed.nbytes == layer.out_features * layer.in_features * 4 // 8


def test_quantized_embeddings(tiny_source):
    model, tok = load(str(tiny_source))
    quantize_model(model, DATA_FREE)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    text = generate(model, tok, "hello", max_tokens=4)
    assert isinstance(text, str)


def test_artifact_round_trip_and_generate(tiny_source, tmp_path):
    info = run(tiny_source, tmp_path / "q", 3, "auto", seed=5, progress=lambda s: None)
    assert info["quantize_seconds"] > 0 and info["peak_rss_bytes"] > 0
    names = {p.name for p in (tmp_path / "q").iterdir()}
    assert {"quantized.safetensors", "quantized.json", "reference.safetensors", "reference.json",
            "config.json", "tokenizer.json"} <= names
    ref = json.loads((tmp_path / "q" / "reference.json").read_text())
    assert ref["environment"]["blas"]
    model, tok = load_quantized(tmp_path / "q")
    stored = mx.load(str(tmp_path / "q" / "reference.safetensors"))
    logits = model(stored["tokens.0"][None]).astype(mx.float32)[0]
    assert np.array_equal(np.array(logits), np.array(stored["logits.0"]))
    assert isinstance(generate(model, tok, "The", max_tokens=5), str)
    assert not list(tmp_path.glob(".q.*"))  # no temp dir left behind


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bits", "5"], "unsupported bits 5"),
        (["--rotation", "givens"], "unknown rotation 'givens'"),
        (["--dtype", "int8"], "unknown dtype 'int8'"),
        (["--group-size", "48"], "group size 48 must be a positive integer dividing in_features 256"),
        (["--group-size", "0"], "group_size must be a positive integer"),
        (["--calibration", "text", "--calib-windows", "0"], "calib_windows must be an integer of at least 1"),
        (["--calibration", "text", "--damp", "2"], "damp must be in (0, 1)"),
        (["--budget", "1"], "budget must be auto, none or bits per weight"),
    ],
)
def test_cli_bad_input(tiny_source, tmp_path, capsys, args, message):
    assert main(["--source", str(tiny_source), "--out", str(tmp_path / "q"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_calibrated_artifact_round_trip(tiny_llama_source, tmp_path):
    """--calibration text --group-size: GPTQ codes and group scales survive the artifact."""
    info = run(tiny_llama_source, tmp_path / "q", 4, "auto", group_size=64, calibration="text",
               calib_windows=2, calib_length=64, progress=lambda s: None)
    assert info["calibration"]["windows"] == 2 and info["calibration"]["provenance"]["split_rule"]
    linears = [r for r in info["records"] if r["kind"] == "linear"]
    assert linears and all(r["calibrated"] and r["group_size"] == 64 for r in linears)
    # the (default) quantized embedding stays data-free, with one scale per row
    assert all(not r["calibrated"] and r["group_size"] is None for r in info["records"] if r["kind"] == "embedding")
    model, _ = load_quantized(tmp_path / "q")
    layer = model.model.layers[0].mlp.down_proj
    assert layer.group_size == 64 and layer.scales.shape == (512, 1472 // 64)
    stored = mx.load(str(tmp_path / "q" / "reference.safetensors"))
    logits = model(stored["tokens.0"][None]).astype(mx.float32)[0]
    assert np.array_equal(np.array(logits), np.array(stored["logits.0"]))


def test_cli_missing_source(tmp_path, capsys):
    assert main(["--source", str(tmp_path), "--out", str(tmp_path / "q")]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_model_without_linear_layers():
    class NoLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(8)

    with pytest.raises(ValueError, match="no nn.Linear layers"):
        quantize_model(NoLinear(), DATA_FREE)


@pytest.mark.parametrize("field, value", [
    ("bits", 5), ("rotation", "givens"), ("dtype", "int8"), ("dtype", mx.int32), ("group_size", 0),
    ("group_size", 1.5), ("damp", 1.0), ("budget", "half"), ("budget", 2.0), ("threads", 0),
    ("layer_bits", [{"match": "v_proj"}]), ("calib_text", "wiki"), ("calib_windows", 0), ("calib_length", 1),
])
def test_config_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        QuantizeConfig(**{field: value})


def test_config_keeps_dtype_by_name():
    assert QuantizeConfig(dtype=mx.bfloat16) == QuantizeConfig(dtype="bfloat16")
    assert QuantizeConfig(dtype=mx.bfloat16).dtype == "bfloat16" and QuantizeConfig().dtype is None


def test_default_config_needs_calibration_data(tiny_source):
    """The default (the CLI's: calibrated on the shipped text) with no data asks for it; the model is untouched."""
    model, _ = load(str(tiny_source))
    with pytest.raises(ValueError, match="pass tokenizer="):
        quantize_model(model)
    with pytest.raises(ValueError, match="calib_text 'self' needs the model's tokenizer"):
        quantize_model(model, QuantizeConfig(calib_text="self"))
    assert not quantized_layers(model)
    with pytest.raises(TypeError, match="QuantizeConfig"):
        quantize_model(model, 4)
