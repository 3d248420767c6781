"""experiments.decode_shapes on a small preset (the 8B preset it exists for is never built here)."""

import json

import mlx.core as mx
import pytest

from experiments import decode_shapes
from vqpipe.layers.fused import fused_groups
from vqpipe.layers.qlinear import QuantizedEmbedding, QuantizedLinear


def test_random_vqpipe_model_is_complete():
    model = decode_shapes.random_vqpipe("tiny-llama", 3)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.lm_head, QuantizedLinear)
    assert not [n for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Embedding")]
    assert len(fused_groups(model)) == 2 * len(model.model.layers)
    out = model(mx.array([[1, 2, 3]]))
    assert out.shape == (1, 3, 8192) and mx.isfinite(out).all().item()


def test_residual_arm_is_the_rotated_layout():
    """The same codes as vqpipe-bN, laid out as a residual-rotated model: the stream's readers and the
    embedding unrotated, a tied head reading its map; fewer primitives per eager decode step."""
    from mlx_lm.models.cache import make_prompt_cache

    from vqpipe.quant import residual_rotation as rr

    for preset in ("tiny-llama", "tiny"):
        plain, res = decode_shapes.random_vqpipe(preset, 3), decode_shapes.random_vqpipe(preset, 3, residual=True)
        layers = {n: m for n, m in res.named_modules() if isinstance(m, QuantizedLinear)}
        assert all((m.rotation.kind == "none") == rr.unrotated(n) for n, m in layers.items())
        emb = res.model.embed_tokens
        assert (emb.head is not None) == rr.tied(res) == (rr.of(res) is not None)
        assert mx.array_equal(emb.packed, plain.model.embed_tokens.packed).item()
        ops = []
        for model in (plain, res):
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))
            ops.append(decode_shapes.graph_ops(model(mx.array([[4]]), cache=cache))["ops"])
        assert ops[0] - ops[1] >= 2 * len(res.model.layers) - 1, (preset, ops)


def test_runs_on_cpu(tmp_path):
    out = tmp_path / "s.json"
    with mx.stream(mx.cpu):
        assert decode_shapes.main(["--preset", "tiny-llama", "--out", str(out), "--bits", "4", "2",
                                   "--prologue-bits", "4", "--residual-bits", "2", "--prompt-lengths", "16",
                                   "--gen-tokens", "3", "--repeats", "2", "--copy-mib", "16"]) == 0
    doc = json.loads(out.read_text())
    arms = {r["arm"] for r in doc["records"]}
    assert arms == {"bf16", "affine4", "vqpipe-b4", "vqpipe-b2", "vqpipe-b4+rot", "vqpipe-b2-res"}
    assert any(c["other_arm"] == "vqpipe-b2-res" and c["baseline_arm"] == "vqpipe-b2" for c in doc["comparisons"])
    prof = doc["step_profile"]
    assert set(prof) == arms and all(p["ops"] > 0 and p["step_s"]["median"] > 0 for p in prof.values())
    # the quantized arms run other primitives than the bf16 matmuls
    assert "QuantizedMatmul" in prof["affine4"]["by_primitive"] and "QuantizedMatmul" not in prof["bf16"]["by_primitive"]
    assert any(c["other_arm"] == "vqpipe-b4+rot" and c["baseline_arm"] == "vqpipe-b4" for c in doc["comparisons"])
    dec = [r for r in doc["records"] if r["phase"] == "decode"]
    assert all(r["n"] == 2 and r["median"] > 0 and r["bytes_per_token"] > 0 for r in dec)
    w = doc["weights"]
    assert w["vqpipe-b2"]["weight_bytes"] < w["vqpipe-b4"]["weight_bytes"] < w["affine4"]["weight_bytes"] < w["bf16"]["weight_bytes"]
    assert any(c["other_arm"] == "vqpipe-b4" and c["baseline_arm"] == "affine4" for c in doc["comparisons"])


def test_compiled_arms_on_cpu(tmp_path):
    out = tmp_path / "c.json"
    with mx.stream(mx.cpu):
        assert decode_shapes.main(["--preset", "tiny-llama", "--out", str(out), "--bits", "2", "--compiled", "--split",
                                   "--prompt-lengths", "16", "--gen-tokens", "3", "--repeats", "2", "--copy-mib", "16"]) == 0
    doc = json.loads(out.read_text())
    arms = {r["arm"] for r in doc["records"]}
    assert arms == {"bf16", "affine4", "vqpipe-b2", "bf16+c", "affine4+c", "vqpipe-b2+c", "bf16+s", "affine4+s", "vqpipe-b2+s"}
    prof = doc["step_profile"]
    for arm in ("bf16", "affine4", "vqpipe-b2"):  # the compiled trace fuses elementwise chains
        assert prof[arm + "+c"]["ops"] < prof[arm]["ops"]
        fused = {a: sum(n for k, n in prof[a]["by_primitive"].items() if k.startswith("Compiled")) for a in (arm, arm + "+c")}
        assert fused[arm + "+c"] > fused[arm]  # (mlx-lm compiles its SwiGLU itself)
    pairs = {(c["baseline_arm"], c["other_arm"]) for c in doc["comparisons"]}
    assert {("vqpipe-b2", "vqpipe-b2+c"), ("bf16+c", "vqpipe-b2+c"), ("affine4+c", "vqpipe-b2+c"), ("bf16", "bf16+c"),
            ("vqpipe-b2", "vqpipe-b2+s"), ("vqpipe-b2+c", "vqpipe-b2+s"), ("bf16+s", "vqpipe-b2+s")} <= pairs
    assert len(pairs) == len(doc["comparisons"]) // 2  # one comparison per pair and phase
    same = {t["b"]: t for t in doc["texts"] if t.get("what", "").startswith("compiled")}
    assert set(same) == {"affine4+c", "vqpipe-b2+c", "affine4+s", "vqpipe-b2+s"} and all(t["pairs"] == 2 for t in same.values())


def test_split_only_and_aa_arm_on_cpu(tmp_path):
    out = tmp_path / "p.json"
    with mx.stream(mx.cpu):
        assert decode_shapes.main(["--preset", "tiny-llama", "--out", str(out), "--bits", "2", "--split-only",
                                   "--aa-arm", "vqpipe-b2+s", "--prompt-lengths", "16", "--gen-tokens", "3",
                                   "--repeats", "2", "--copy-mib", "16"]) == 0
    doc = json.loads(out.read_text())
    assert {r["arm"] for r in doc["records"]} == {"bf16+s", "affine4+s", "vqpipe-b2+s"}
    assert doc["settings"]["aa_arm"] == "vqpipe-b2+s"
    aa = [t for t in doc["texts"] if t.get("what", "").startswith("A/A")]
    assert [(t["a"], t["b"]) for t in aa] == [("vqpipe-b2+s", "vqpipe-b2+s" + decode_shapes.harness.AA_SUFFIX)]
    assert doc["step_profile"]["vqpipe-b2+s"]["by_primitive"].get("ScatterAxis") == 4  # the KV writes, 2 layers
    with pytest.raises(ValueError, match="aa-arm"):
        decode_shapes.run(decode_shapes.parse_args(["--preset", "tiny-llama", "--out", str(out), "--split-only",
                                                    "--aa-arm", "bf16", "--copy-mib", "16"]), progress=lambda *_: None)
