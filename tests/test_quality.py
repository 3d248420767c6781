"""bench-quality: arms, honest bits per weight, dense evaluation copies, the artifact's shape."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from vqpipe import text
from vqpipe.stages import bench_quality as q
from vqpipe.stages.quantize import run as quantize_run


def test_bits_per_weight_counts_everything(tiny_source):
    model, _, bpw = q.affine_arm(tiny_source, 4, 64)
    # bf16 source: codes 4 + a 16-bit scale and a 16-bit bias per 64 weights.
    assert bpw["bpw"] == pytest.approx(4.5) and bpw["parts_bpw"]["scales"] == pytest.approx(0.25)
    model, _, bpw = q.vqpipe_arm(tiny_source, 3, "auto", 0)
    layers = [m for _, m in model.named_modules() if hasattr(m, "to_state")]
    n = sum(m.in_features * m.out_features for m in layers)
    # 3-bit codes (scalar: rows padded to 32 values; trellis: exactly 3 bits a weight), a float32
    # scale per row, a codebook (scalar: 8 float32 entries per layer; trellis: the 1024-entry table
    # once per model) and the rotation's arrays (signs, Kronecker factors) as persist_rotation stores them.
    trellis = [m for m in layers if m.codes == "trellis"]
    scalar = [m for m in layers if m.codes == "scalar"]
    assert trellis  # the default codes
    codes = sum(m.out_features * -(-m.in_features // 32) * 32 * 3 for m in scalar)
    codes += sum(m.out_features * m.in_features * 3 for m in trellis)
    scales = sum(m.out_features * 32 for m in layers)
    books = len(scalar) * 8 * 32 + 1024 * 32
    assert bpw["bpw_seed_rotation"] == pytest.approx((codes + scales + books) / n)
    assert bpw["bpw"] > bpw["bpw_seed_rotation"] and bpw["parts_bpw"]["rotation"] > 0
    assert bpw["quantized_weights"] == n and bpw["unquantized_params"]["embed_tokens"] > 0


@pytest.mark.parametrize("arm", ["vqpipe", "affine"])
def test_dense_copy_matches_quantized_forward(tiny_source, arm):
    if arm == "affine":
        model, _, _ = q.affine_arm(tiny_source, 4, 64)
    else:
        model, _, _ = q.vqpipe_arm(tiny_source, 4, "auto", 0)
    ids = mx.array([[5, 17, 300, 42, 7, 99, 1000, 3]])
    want = model(ids)
    dense = q.dense_copy(model)
    assert not any(isinstance(m, nn.QuantizedLinear) or hasattr(m, "to_state") for _, m in dense.named_modules())
    got = dense(ids)
    assert mx.abs(got - want).max().item() < 1e-3 * mx.abs(want).max().item()


def test_quality_artifact(tiny_source, tmp_path):
    arts = []
    for rot in ("auto", "none"):
        arts.append(tmp_path / f"b2-{rot}")
        quantize_run(tiny_source, arts[-1], 2, rot, progress=lambda *_: None)
    out = tmp_path / "quality.json"
    rc = q.main(["--source", str(tiny_source), "--bits", "2", "--quantized", *map(str, arts),
                 "--arms", "vqpipe", "unrotated", "affine-g64", "--affine-groups", "64", "--windows", "20", "--length", "16", "--gen-prompts", "1",
                 "--gen-tokens", "2", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [r["method"] for r in doc["records"]] == ["vqpipe", "unrotated", "affine-g64"]
    vq = doc["records"][0]
    assert vq["artifact"] == str(arts[0]) and vq["rotation"] == "auto"
    stored = json.loads((arts[0] / "quantized.json").read_text())["records"]
    assert vq["weight_rel_mse"] == pytest.approx(sum(r["squared_error"] for r in stored)
                                                 / sum(r["weight_sq"] for r in stored))
    for r in doc["records"]:
        assert r["kl"]["n"] == r["ppl"]["n"] == r["top1"]["n"] == 20 and r["kl"]["min"] >= 0
        assert r["ppl"]["min"] > 1 and 0 <= r["top1"]["median"] <= 1
    # 2 bits: rotation must beat no rotation on the synthetic outlier channels.
    assert doc["records"][0]["kl"]["median"] < doc["records"][1]["kl"]["median"]
    assert doc["source"]["full_precision"] is True and doc["source"]["ppl"]["n"] == 20
    assert doc["text"]["package"] == "Debian dict-devil" and doc["length"] == 16
    arms = doc["generations"]["arms"]
    assert [a["arm"] for a in arms] == ["source", "2-bit vqpipe", "2-bit unrotated", "2-bit affine-g64"]
    assert all(len(a["texts"]) == 1 for a in arms)


def test_windows_come_from_the_eval_split(tiny_source):
    _, tok = q.load_source(tiny_source)
    ev = text.tokens(tok, "eval")
    w = text.eval_windows(tok, 20, 16)
    assert w[5].tolist() == ev[5 * ((len(ev) - 16) // 19):][:16]


def test_too_many_windows_is_a_clean_error(tiny_source, tmp_path, capsys):
    rc = q.main(["--source", str(tiny_source), "--bits", "4", "--windows", "20", "--length", "100000",
                 "--out", str(tmp_path / "x.json")])
    assert rc == 2 and "too few" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_affine_group_that_does_not_divide_is_skipped(tiny_llama_source):
    # tiny-llama's MLP width 1472 = 23 x 64: MLX affine g128 cannot quantize down_proj.
    with pytest.raises(q.SkippedArm, match="1472"):
        q.affine_arm(tiny_llama_source, 4, 128)
