"""bench-quality's competitor arms (vqpipe/bench/competitors.py): mlx-lm's gptq, awq, dynamic_quant, dwq and
MLX's mxfp4 / nvfp4 on a tiny model, their bits per weight against a hand count, their refusals."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from vqpipe.bench import competitors
from vqpipe import text
from vqpipe.stages import bench_quality as q


@pytest.fixture(scope="module")
def shapes(tiny_llama_source):
    """{module name: (out, in)} of the source's weight matrices (tiny-llama: untied lm_head)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_llama_source, lazy=True)
    return {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}


@pytest.fixture(scope="module")
def calib(tiny_llama_source):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(tiny_llama_source)
    return lambda: text.calibration_tokens(tok, 4, 32, seed=0)


def hand_bpw(shapes, per_layer):
    """Stored bits over weights: ``per_layer(name)`` gives a matrix's bits per weight (None: dense)."""
    bits = weights = 0
    for name, (o, i) in shapes.items():
        b = per_layer(name)
        if b is not None:
            bits, weights = bits + b * o * i, weights + o * i
    return bits / weights


def bpw_of(bits, group, scale_bits=16, biases=True):
    """An MLX quantized layer's bits per weight: codes + a scale (and a bias) per group."""
    return bits + scale_bits * (2 if biases else 1) / group


def test_gptq_counts_its_fallback_embedding(tiny_llama_source, shapes, calib):
    model, werr, bpw, info = q.competitor_arm(tiny_llama_source, "mlx-gptq", 4, calib)
    # every nn.Linear (lm_head too) GPTQ'd at 4 bits g64, bf16 scales and biases; the embedding at
    # mlx-lm's fallback, 6 bits g64
    want = hand_bpw(shapes, lambda n: bpw_of(6, 64) if n.endswith("embed_tokens") else bpw_of(4, 64))
    assert bpw["bpw"] == pytest.approx(want) and bpw["bpw_matrices"] == pytest.approx(want)
    assert info["embedding"] == {"bits": 6, "group_size": 64, "mode": "affine"} and info["calibration"] == [4, 32]
    assert 0 < werr < 0.05 and bpw["unquantized_params"].get("embed_tokens") is None
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())  # the dense copy


def test_gptq_refuses_three_bits_before_any_work(tiny_llama_source):
    with pytest.raises(q.SkippedArm, match="Unsupported bits 3"):
        q.competitor_arm("/nonexistent", "mlx-gptq", 3, lambda: pytest.fail("no calibration for a refusal"))


def test_awq_counts_its_embedding_and_head(tiny_llama_source, shapes, calib):
    _, werr, bpw, info = q.competitor_arm(tiny_llama_source, "mlx-awq", 3, calib)
    # blocks at 3 bits g64; the embedding and the (untied) head at AWQ's 4 bits g32
    want = hand_bpw(shapes, lambda n: bpw_of(4, 32) if n.endswith(("embed_tokens", "lm_head")) else bpw_of(3, 64))
    assert bpw["bpw"] == pytest.approx(want)
    assert info["embedding"]["bits"] == 4 and info["embed_group_size"] == 32
    assert werr is None  # AWQ's scales move into the norms: its weights are not the source's


def test_dynamic_mixes_two_widths_at_the_budget(tiny_llama_source, shapes, calib):
    model, _, bpw, info = q.competitor_arm(tiny_llama_source, "mlx-dynamic", 4, calib, target_bpw=4.5)
    assert (info["low_bits"], info["high_bits"]) == competitors.dynamic_widths(4) == (3, 5)
    assert info["layers_high"] > 0 and info["layers_low"] > 0
    assert info["layers_high"] + info["layers_low"] == len(shapes)
    # within the budget (coarse on a model of 16 matrices, two of them 8192 x 512)
    assert bpw_of(3, 64) < bpw["bpw_mlx_lm"] < 4.5 + 0.05
    # the hand count, with the width the search gave each layer (embedding included)
    assert set(info["widths"]) == set(shapes)
    assert bpw["bpw"] == pytest.approx(hand_bpw(shapes, lambda n: bpw_of(info["widths"][n], 64)))
    assert competitors.dynamic_widths(2) == (2, 3)


def test_dwq_distils_the_affine_models_scales(tiny_llama_source, shapes):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(tiny_llama_source)
    calib = lambda: text.calibration_tokens(tok, 12, 32, seed=0)  # noqa: E731
    # 8 training windows, 2 steps of 4 (1e-4 overshoots on this model: its loss rises 1.2 -> 5.2)
    model, werr, bpw, info = q.competitor_arm(tiny_llama_source, "mlx-dwq", 2, calib, dwq_lr=1e-5)
    # every layer, the embedding too, at 2 bits g64 (mlx_lm.dwq's quantize_model), bf16 scales and biases
    assert bpw["bpw"] == pytest.approx(hand_bpw(shapes, lambda n: bpw_of(2, 64)))
    assert info["embedding"] == {"bits": 2, "group_size": 64, "mode": "affine"}
    assert (info["steps"], info["train_windows"], info["valid_windows"]) == (2, 8, 4)
    # its own validation loss (KL at temperature 2 on held-out calibration windows) fell
    assert info["valid_loss_after"] < 0.97 * info["valid_loss_before"]
    _, _, _, still = q.competitor_arm(tiny_llama_source, "mlx-dwq", 2, calib, dwq_lr=1e-12)
    assert still["valid_loss_after"] == pytest.approx(still["valid_loss_before"], abs=1e-3)  # the steps did it
    with pytest.raises(ValueError, match="at least 8 calibration windows"):
        q.competitor_arm(tiny_llama_source, "mlx-dwq", 2, lambda: text.calibration_tokens(tok, 5, 32, seed=0))


@pytest.mark.parametrize("mode,group,scale_bits", [("mxfp4", 32, 8), ("nvfp4", 16, 8)])
def test_fp4_modes(tiny_llama_source, shapes, mode, group, scale_bits):
    _, werr, bpw, info = q.competitor_arm(tiny_llama_source, mode, 4, None, embeddings=False)
    # 4-bit floats, one 8-bit scale per group, no biases; the embedding dense (bf16) unless asked
    lin = bpw_of(4, group, scale_bits, biases=False)
    assert bpw["bpw"] == pytest.approx(hand_bpw(shapes, lambda n: None if n.endswith("embed_tokens") else lin))
    assert bpw["bpw_matrices"] == pytest.approx(
        hand_bpw(shapes, lambda n: 16 if n.endswith("embed_tokens") else lin))
    assert info == {"mode": mode, "group_size": group, "embedding": None} and 0 < werr < 0.05
    _, _, bpw, info = q.competitor_arm(tiny_llama_source, mode, 4, None, embeddings=True)
    assert bpw["bpw"] == pytest.approx(lin) and info["embedding"]["mode"] == mode
    with pytest.raises(q.SkippedArm, match="4-bit floats only"):
        q.competitor_arm("/nonexistent", mode, 3, None)  # refused before any model is read


def test_default_arms_leave_out_the_costly_ones():
    names = [m for m, _ in q.check_arms(None, (64,))]
    assert names == ["vqpipe", "unrotated", "affine-g64", "mlx-gptq", "mxfp4", "nvfp4"]
    assert [m for m, _ in q.check_arms(["mlx-dynamic", "mlx-awq"], (64,))] == ["mlx-awq", "mlx-dynamic"]
    assert [m for m, _ in q.check_arms(["mlx-dwq"], (64,))] == ["mlx-dwq"]
    with pytest.raises(ValueError, match="unknown arms"):
        q.check_arms(["mlx-qat"], (64,))


def test_calibration_is_the_calibrate_stages_draw(tiny_llama_source):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(tiny_llama_source)
    opts = q.arm_options(calib_windows=8, calib_length=16, calib_seed=0, awq_windows=3)
    full = q.calibration(tok, opts)
    assert full.shape == (8, 16) and mx.array_equal(full, text.calibration_tokens(tok, 8, 16, 0))
    few = q.calibration(tok, opts, opts["awq_windows"])
    assert few.shape == (3, 16)  # rows 0, 4 (3.5 rounds to even) and 7 of the same draw
    assert [int(mx.argmax(mx.all(full == r, axis=1)).item()) for r in few] == [0, 4, 7]
    with pytest.raises(ValueError, match="awq_windows must be at least 1"):
        q.arm_options(awq_windows=0)


def test_competitor_parts_on_both_texts(tiny_llama_source, tmp_path, capsys):
    common = ["--source", str(tiny_llama_source), "--windows", "2", "--length", "16", "--gen-prompts", "1",
              "--gen-tokens", "2", "--calib-windows", "2", "--calib-length", "16"]
    ref = tmp_path / "ref"
    assert q.main([*common, "--reference-out", str(ref)]) == 0
    parts = []
    for bits, arm in ((4, "mxfp4"), (3, "mlx-gptq"), (2, "mlx-dynamic"), (2, "affine-g64")):
        parts.append(tmp_path / f"b{bits}-{arm}.json")
        extra = ["--dynamic-bpw", "2.8"] if arm == "mlx-dynamic" else []
        assert q.main([*common, "--reference", str(ref), "--bits", str(bits), "--arms", arm, "--no-embeddings",
                       *extra, "--out", str(parts[-1])]) == 0
    out = tmp_path / "quality.json"
    assert q.main(["--merge", *map(str, parts), "--out", str(out)]) == 0  # the record schema is checked
    doc = json.loads(out.read_text())
    assert list(doc["texts"]) == ["devil", "jargon"] and doc["texts"]["jargon"]["package"] == "Debian dict-jargon"
    assert doc["text"] == doc["texts"]["devil"]
    recs = {r["method"]: r for r in doc["records"]}
    assert "Unsupported bits 3" in recs["mlx-gptq"]["skipped"]
    for m in ("mxfp4", "mlx-dynamic", "affine-g64"):
        r = recs[m]
        assert list(r["texts"]) == ["devil", "jargon"] and r["kl"] == r["texts"]["devil"]["kl"]
        for t in r["texts"].values():
            assert t["kl"]["n"] == 2 and t["kl"]["min"] >= 0 and t["ppl"]["min"] > 1
    assert recs["mlx-dynamic"]["settings"]["target_bpw"] == 2.8 and recs["mxfp4"]["bpw"]["bpw"] == pytest.approx(4.25)
    assert doc["source"]["texts"]["jargon"]["ppl"]["n"] == 2
    # the report: one row per metric and text, the other text's columns in the quality table
    from vqpipe.stages import report

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "quality.json").write_text(out.read_text())
    assert report.main(["--inputs", str(tmp_path / "in"), "--out", str(tmp_path / "report")]) == 0
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    rows = [r for v in summary["models"][doc["model"]].values() for r in v.get("quality", [])]
    kl = {(r["method"], r["text"]): r for r in rows if r["metric"] == "kl"}
    assert kl[("mxfp4", "jargon")]["median"] == recs["mxfp4"]["texts"]["jargon"]["kl"]["median"]
    assert kl[("mxfp4", "devil")]["median"] == recs["mxfp4"]["kl"]["median"]
    assert kl[("mxfp4", "devil")]["bpw_matrices"] == recs["mxfp4"]["bpw"]["bpw_matrices"]
    md = (tmp_path / "report" / "report.md").read_text()
    assert "KL (jargon)" in md and "Unsupported bits 3" in md
    # the pipeline schedules no fp4 job at 2 or 3 bits: the merge records the tool's refusal in
    # their place (the record a refusing job writes), and fails on an arm neither measured nor refused
    expect = ["2:affine-g64", "2:mlx-dynamic", "2:mxfp4", "3:mlx-gptq", "3:nvfp4", "4:mxfp4"]
    assert q.main(["--merge", *map(str, parts), "--expect", *expect, "--out", str(out)]) == 0
    recs = json.loads(out.read_text())["records"]
    assert [(r["bits"], r["method"]) for r in recs] == [(int(e[0]), e[2:]) for e in expect]
    assert recs[2] == {"bits": 2, "method": "mxfp4", "skipped": "MLX's mxfp4 mode stores 4-bit floats only, not 2 bits"}
    assert recs[4]["skipped"] == "MLX's nvfp4 mode stores 4-bit floats only, not 3 bits"
    skipped = tmp_path / "b2-nvfp4.json"  # what the job the pipeline no longer runs wrote
    assert q.main([*common, "--reference", str(ref), "--bits", "2", "--arms", "nvfp4", "--no-embeddings",
                   "--out", str(skipped)]) == 0
    assert json.loads(skipped.read_text())["records"] == [{"bits": 2, "method": "nvfp4",
                                                          "skipped": "MLX's nvfp4 mode stores 4-bit floats only, not 2 bits"}]
    for bad in (expect + ["3:affine-g64"], expect[1:]):  # not measured nor refused; a part not asked for
        assert q.main(["--merge", *map(str, parts), "--expect", *bad, "--out", str(tmp_path / "x.json")]) == 2
    capsys.readouterr()
    # mlx-dynamic needs a budget: the vqpipe artifact of its width, or --dynamic-bpw
    rc = q.main([*common, "--reference", str(ref), "--bits", "2", "--arms", "mlx-dynamic", "--out", str(tmp_path / "x.json")])
    assert rc == 2 and "needs a budget" in capsys.readouterr().err
    # a reference of other texts is refused
    rc = q.main([*common, "--reference", str(ref), "--texts", "jargon", "--bits", "4", "--arms", "mxfp4",
                 "--out", str(tmp_path / "x.json")])
    assert rc == 2 and "holds the texts" in capsys.readouterr().err
