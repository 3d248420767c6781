"""Download stage and synthetic sources (tiny presets only; the session fixtures live in conftest)."""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from vqpipe.sources import synth
from vqpipe.stages import download
from vqpipe.stages.download import fetch

ROOT = Path(__file__).resolve().parents[1]


def file_hashes(path):
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def source_info(path):
    return json.loads((path / "vqpipe-source.json").read_text())


def weights(path):
    return {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(path / "model.safetensors")).items()}


# --- determinism -------------------------------------------------------------------------------


def test_same_seed_is_byte_identical(tiny_source, tmp_path):
    # A fresh process: tokenizer training and hashing must not depend on process state.
    result = run_cli("--source", "synth:tiny", "--out", str(tmp_path / "tiny"), "--seed", "0")
    assert result.returncode == 0, result.stderr
    assert file_hashes(tmp_path / "tiny") == file_hashes(tiny_source)


def test_seed_changes_weights_not_tokenizer(tiny_source, tmp_path):
    synth.train_bpe.cache_clear()  # retrain: the tokenizer must come out the same
    other = file_hashes(fetch("synth:tiny", tmp_path / "tiny", seed=1))
    base = file_hashes(tiny_source)
    assert other["model.safetensors"] != base["model.safetensors"]
    assert other["tokenizer.json"] == base["tokenizer.json"]


def test_4bit_is_byte_identical(tiny_4bit_source, tmp_path):
    again = fetch("synth:tiny-4bit", tmp_path / "tiny-4bit", seed=0)
    assert file_hashes(again) == file_hashes(tiny_4bit_source)


def test_shipped_corpus_matches_its_generator():
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "scripts/make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.corpus_text() == (ROOT / "vqpipe/data/corpus.txt").read_text(encoding="utf-8")


# --- mlx_lm compatibility ----------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_source", "tiny_llama_source", "tiny_4bit_source"])
def test_load_and_generate(fixture, request):
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    path = request.getfixturevalue(fixture)
    model, tokenizer = load(str(path))
    config = json.loads((path / "config.json").read_text())
    assert len(tokenizer._tokenizer) == config["vocab_size"]

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "How do I keep a garden through the dry months?"}],
        add_generation_prompt=True,
    )
    mx.random.seed(0)
    ids = [
        r.token
        for r in stream_generate(model, tokenizer, prompt, max_tokens=24, sampler=make_sampler(temp=1.0))
    ]
    assert ids and all(0 <= i < config["vocab_size"] for i in ids)
    assert all(isinstance(tokenizer.decode([i]), str) for i in ids)
    assert isinstance(tokenizer.decode(ids), str)


@pytest.mark.parametrize("fixture", ["tiny_source", "tiny_llama_source"])
def test_every_id_decodes_and_fillers_are_never_encoded(fixture, request):
    from tokenizers import Tokenizer

    path = request.getfixturevalue(fixture)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    config = json.loads((path / "config.json").read_text())
    vocab_size = config["vocab_size"]
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    assert all(tok.id_to_token(i) is not None for i in range(vocab_size))
    assert tok.decode(list(range(vocab_size)), skip_special_tokens=False)

    text = (ROOT / "vqpipe/data/corpus.txt").read_text(encoding="utf-8")[:60000]
    text += "\nNaïve café at 21 °C — 5 € ≈ 4.3 £; emoji 🙂 and 中文."
    ids = tok.encode(text, add_special_tokens=False).ids
    n_bpe = source_info(path)["synth"]["tokenizer_bpe_tokens"]
    assert max(ids) < n_bpe  # padding entries decode but are never produced
    assert tok.decode(ids) == text


def test_config_and_weights_match_preset(tiny_source):
    config = json.loads((tiny_source / "config.json").read_text())
    expected = synth.PRESETS["tiny"]
    assert {k: config[k] for k in expected} == expected
    assert config["torch_dtype"] == "bfloat16"
    raw = mx.load(str(tiny_source / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for v in raw.values())
    assert raw["model.embed_tokens.weight"].shape == (config["vocab_size"], config["hidden_size"])
    assert "model.layers.0.self_attn.k_proj.bias" in raw and "lm_head.weight" not in raw
    info = source_info(tiny_source)
    assert info["parameters"] == synth.param_count(config) == sum(v.size for v in raw.values())


def test_4bit_source_is_quantized(tiny_source, tiny_4bit_source):
    from mlx_lm.utils import load_model

    config = json.loads((tiny_4bit_source / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    model, _ = load_model(tiny_4bit_source)
    layers = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert len(layers) == 7 * config["num_hidden_layers"]
    assert all(m.group_size == 64 and m.bits == 4 for m in layers)
    assert source_info(tiny_4bit_source)["parameters"] == source_info(tiny_source)["parameters"]


# --- weight structure --------------------------------------------------------------------------


def test_outlier_channels_and_heavy_tails(tiny_source):
    w = weights(tiny_source)
    outliers = source_info(tiny_source)["synth"]["hidden_outlier_channels"]
    assert len(outliers) >= 2
    for name in ("self_attn.q_proj", "mlp.up_proj"):
        q = w[f"model.layers.0.{name}.weight"]
        col_rms = np.sqrt(np.mean(q * q, axis=0))
        assert col_rms[outliers].min() > 4 * np.median(col_rms), name
    down = w["model.layers.1.mlp.down_proj.weight"]
    col_rms = np.sqrt(np.mean(down * down, axis=0))
    assert col_rms.max() > 6 * np.median(col_rms)

    # Heavy tails: excess kurtosis of row-normalised weights, outlier columns removed.
    keep = np.setdiff1d(np.arange(q.shape[1]), outliers)
    x = w["model.layers.0.mlp.gate_proj.weight"][:, keep]
    x = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True))
    assert np.mean(x**4) - 3 > 1.0

    norm = w["model.layers.0.input_layernorm.weight"]
    assert np.std(norm) > 0.1 and not np.allclose(norm, 1.0)
    row_norms = np.linalg.norm(w["model.layers.0.self_attn.o_proj.weight"], axis=1)
    assert np.std(row_norms) / np.mean(row_norms) > 0.1
    layer_rms = [np.sqrt(np.mean(w[f"model.layers.{i}.mlp.gate_proj.weight"] ** 2)) for i in (0, 1)]
    assert abs(layer_rms[0] / layer_rms[1] - 1) > 0.01


@pytest.mark.parametrize("fixture", ["tiny_source", "tiny_llama_source"])
def test_forward_pass_is_numerically_sane(fixture, request):
    from mlx_lm import load
    from mlx_lm.models.base import create_attention_mask

    model, tokenizer = load(str(request.getfixturevalue(fixture)))
    ids = mx.array([tokenizer.encode("Mira repaired the old clock at the harbour before dawn. " * 3)])
    h = model.model.embed_tokens(ids)
    mask = create_attention_mask(h, None)
    for layer in model.model.layers:
        h = layer(h, mask, None)
        rms = float(mx.sqrt(mx.mean(h.astype(mx.float32) ** 2)))
        assert 0.01 < rms < 100
    logits = model(ids).astype(mx.float32)
    assert bool(mx.all(mx.isfinite(logits)))
    assert 1.0 < float(mx.std(logits)) < 10.0
    # The prediction depends on the context, not only on a few outlier channels.
    assert len(set(mx.argmax(logits[0], axis=-1).tolist())) > 5


def test_blocks_are_small_updates_that_matter(tiny_source):
    """Each block is a small update of the residual stream, yet the blocks pick the next token."""
    from mlx_lm.models.base import create_attention_mask

    from vqpipe.stages.bench_quality import agreement, load_fp32, logprobs
    from vqpipe.text import corpus_windows

    model, tokenizer = load_fp32(tiny_source)
    ids = corpus_windows(tokenizer, 2, 128)[1]
    h = embedded = model.model.embed_tokens(ids[None])
    mask = create_attention_mask(h, None)
    for layer in model.model.layers:
        new = layer(h, mask, None)
        assert float(mx.linalg.norm(new - h)) < 0.5 * float(mx.linalg.norm(h))
        h = new
    full = logprobs(model, ids)
    # Tied head: the model must not just repeat its input token.
    assert float(mx.mean(mx.argmax(full, axis=-1) == ids)) < 0.1
    # Without the blocks (embedding straight into the head) the prediction changes a lot.
    logits = model.model.embed_tokens.as_linear(model.model.norm(embedded))[0]
    kl, top1 = agreement(full, logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    assert kl > 0.3 and top1 < 0.8


def test_quantization_sensitivity_is_realistic(tiny_source):
    """4-bit affine g64 costs about as much as on a trained model; rotation and more bits help."""
    from vqpipe.stages.bench_quality import agreement, load_fp32, logprobs, quantize_method
    from vqpipe.text import corpus_windows

    source, tokenizer = load_fp32(tiny_source)
    windows = corpus_windows(tokenizer, 4, 128)
    refs = [logprobs(source, w) for w in windows]
    result = {}
    for method, bits in (("affine", 4), ("rotated", 4), ("affine", 2)):
        model, _ = quantize_method(tiny_source, method, bits, 0)
        kls, top1s = zip(*(agreement(r, logprobs(model, w)) for r, w in zip(refs, windows)))
        result[method, bits] = (float(np.median(kls)), float(np.median(top1s)))
    kl4, top4 = result["affine", 4]
    assert 0.01 < kl4 < 0.2 and top4 >= 0.75, result  # a trained Qwen2.5-0.5B: ~0.02-0.1, ~0.9
    assert result["rotated", 4][0] < kl4, result
    assert result["affine", 2][0] > 4 * kl4 and result["affine", 2][1] < top4 - 0.15, result


# --- presets -----------------------------------------------------------------------------------


def hadamard_ok(n):
    return any(n % m == 0 and (n // m) & (n // m - 1) == 0 for m in (1, 12, 20, 28))


def test_presets():
    counts = {name: synth.param_count(synth.make_config(name)) for name in synth.PRESETS}
    assert counts["qwen2.5-0.5b"] == 494_032_768  # the real Qwen2.5-0.5B
    assert counts["llama3-8b"] == 8_030_261_248  # the real Meta-Llama-3-8B (built on GPU hosts only)
    # Qwen3-4B's 4,022,468,096 less its 36 x 2 x 128 q/k-norm weights (the preset has no qk-norm)
    assert counts["qwen3-4b-shapes"] == 4_022_468_096 - 36 * 2 * 128
    assert counts["tiny"] <= 40e6 and counts["tiny-llama"] <= 40e6
    assert not hadamard_ok(synth.PRESETS["tiny"]["intermediate_size"])
    assert not hadamard_ok(synth.PRESETS["tiny-llama"]["intermediate_size"])
    assert synth.PRESETS["llama-1b-ish"]["intermediate_size"] == 11008
    for name in ("tiny-llama", "llama-1b-ish"):
        assert synth.PRESETS[name]["num_key_value_heads"] == 4


def test_head_dim_wider_than_hidden_over_heads(tmp_path, monkeypatch):
    # qwen3-4b-shapes in miniature: 4 heads of 128 on a 256-wide stream (q_proj 256 -> 512)
    from mlx_lm.utils import load_model

    small = {**synth.PRESETS["qwen3-4b-shapes"], "hidden_size": 256, "num_hidden_layers": 1,
             "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8192}
    monkeypatch.setitem(synth.PRESETS, "small-head-dim", small)
    info = synth.build("small-head-dim", tmp_path / "m")
    model, _ = load_model(tmp_path / "m")  # strict: every tensor has the shape mlx-lm expects
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (512, 256) and attn.k_proj.weight.shape == (256, 256)
    assert attn.o_proj.weight.shape == (256, 512)
    raw = mx.load(str(tmp_path / "m" / "model.safetensors"))
    assert info["parameters"] == sum(v.size for v in raw.values())


def test_unknown_preset():
    with pytest.raises(ValueError, match="'nope'.*tiny, tiny-llama"):
        synth.parse_preset("nope")
    with pytest.raises(ValueError, match="'tiny-8bit'"):
        fetch("synth:tiny-8bit", "/nonexistent/never-created")


@pytest.mark.parametrize("source", ["tiny", "ftp:model", "synth:", "hf:", "path:"])
def test_bad_source(source, tmp_path):
    with pytest.raises(ValueError, match="synth:"):
        fetch(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_seed(tmp_path):
    with pytest.raises(ValueError, match="seed"):
        fetch("synth:tiny", tmp_path / "out", seed=-1)


# --- atomic output -----------------------------------------------------------------------------


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(synth, "write_weights", boom)
    with pytest.raises(KeyboardInterrupt):
        fetch("synth:tiny", tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_replaced(tmp_path, tiny_source):
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    fetch(f"path:{tiny_source}", out)
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# --- path: and hf: -----------------------------------------------------------------------------


def test_path_source_copies(tiny_source, tmp_path):
    out = fetch(f"path:{tiny_source}", tmp_path / "copy")
    copied, original = file_hashes(out), file_hashes(tiny_source)
    for name in ("vqpipe-source.json", "manifest.json"):  # both describe their own directory
        copied.pop(name), original.pop(name)
    assert copied == original
    info = source_info(out)
    assert info["scheme"] == "path" and info["parameters"] == source_info(tiny_source)["parameters"]


def test_path_source_errors(tiny_source, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fetch(f"path:{tmp_path / 'missing'}", tmp_path / "out")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes((tiny_source / "model.safetensors").read_bytes())
    with pytest.raises(FileNotFoundError, match="config.json"):
        fetch(f"path:{broken}", tmp_path / "out")
    (broken / "model.safetensors").unlink()
    (broken / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"\*\.safetensors"):
        fetch(f"path:{broken}", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """An unreachable hub endpoint and an empty HF cache."""
    import huggingface_hub.constants

    for var in download.PROXY_VARS + ("HF_HUB_OFFLINE",):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_hf_unreachable_fails_fast(no_hub, tmp_path):
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match="unreachable") as err:
        fetch("hf:Qwen/Qwen2.5-0.5B-Instruct@main", tmp_path / "out")
    assert time.perf_counter() - start < 10
    assert "synth:" in str(err.value) and "path:" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_hf_offline_mode(no_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConnectionError, match="HF_HUB_OFFLINE"):
        fetch("hf:Qwen/Qwen2.5-0.5B-Instruct", tmp_path / "out")


def test_hf_uses_local_cache_when_offline(no_hub, tiny_source, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = no_hub / "models--acme--tiny"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for p in tiny_source.iterdir():
        if p.name != "vqpipe-source.json":
            (snapshot / p.name).write_bytes(p.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    out = fetch("hf:acme/tiny", tmp_path / "out")
    info = source_info(out)
    assert info["repo"] == "acme/tiny" and info["snapshot"] == commit
    assert info["files"]["model.safetensors"] == source_info(tiny_source)["files"]["model.safetensors"]


# --- CLI ---------------------------------------------------------------------------------------


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "vqpipe", "download", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_cli_help():
    result = run_cli("--help")
    assert result.returncode == 0 and "--source" in result.stdout and "qwen2.5-0.5b" in result.stdout


def test_cli_errors_are_clean(tmp_path):
    result = run_cli("--source", "synth:huge", "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "'synth:huge'" not in result.stderr and "'huge'" in result.stderr
    assert "Traceback" not in result.stderr

    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "HTTPS_PROXY": ""}
    start = time.perf_counter()
    result = run_cli("--source", "hf:acme/missing", "--out", str(tmp_path / "out"), env=env)
    assert time.perf_counter() - start < 30
    assert result.returncode == 2 and "unreachable" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_cli_main_builds(tmp_path, capsys):
    assert download.main(["--source", "synth:tiny", "--out", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert "[download]" in capsys.readouterr().out
    info = source_info(tmp_path / "m")
    assert info["source"] == "synth:tiny" and info["seed"] == 3
    assert download.main(["--source", "synth:tiny"]) == 2  # argparse: --out missing
