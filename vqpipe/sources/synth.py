"""Deterministic, offline, synthetic mlx-lm models in Hugging Face layout (``synth:PRESET``).

A preset fixes the architecture; the seed fixes the weights. The tokenizer is a byte-level BPE
trained on ``vqpipe/data/corpus.txt`` and padded with never-merged entries up to the model's
vocab size, so every id the model can emit decodes. The weights carry the structure that makes
rotations matter in real checkpoints (see docs/synth.md): heavy tails, outlier input channels,
per-row and per-layer scale variation, non-trivial RMSNorm weights and Qwen-style key biases.
"""

import functools
import json
import random
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from ..store.fsutil import save_safetensors

DATA = Path(__file__).resolve().parent.parent / "data"

PRESETS = {
    # Builds in about a second; 4864 = 19 * 256 is a width mx.hadamard_transform rejects.
    "tiny": {
        "model_type": "qwen2",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "intermediate_size": 4864,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 8192,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
    },
    # Llama layout: GQA with 4 KV heads, untied lm_head, 1472 = 23 * 64.
    "tiny-llama": {
        "model_type": "llama",
        "hidden_size": 512,
        "num_hidden_layers": 2,
        "intermediate_size": 1472,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 8192,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
    },
    # The shapes of Qwen/Qwen2.5-0.5B-Instruct.
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
    },
    # Llama-2-7B's MLP width (11008 = 172 * 64) on a 1024-wide, 8-layer body with 4 KV heads.
    "llama-1b-ish": {
        "model_type": "llama",
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "intermediate_size": 11008,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
    },
    # The shapes of Meta-Llama-3-8B: where decode is bound by memory bandwidth, not launches. 8 B
    # parameters (16 GB in bf16): built on a GPU host for benchmarks only, never in tests or CI
    # (experiments/decode_shapes.py builds it in device memory without files).
    "llama3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
    },
    # The matrices of Qwen/Qwen3-4B (head_dim 128 > hidden / heads: q_proj 2560 -> 4096, k/v
    # 2560 -> 1024, o_proj 4096 -> 2560), not its per-head q/k RMSNorm (36 x 256 weights, 0.0002 %
    # of the parameters): mlx-lm's llama model takes head_dim and has no qk-norm, and the llama
    # tokenizer style stands in for Qwen's. 4.0 B parameters (8 GB in bf16): for the quantize
    # memory benchmark (scripts/quantize_4b_memory.sh), never built in tests or CI.
    "qwen3-4b-shapes": {
        "model_type": "llama",
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "intermediate_size": 9728,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
    },
    # One small preset per further family of mlx-lm's model classes (docs/models.md, "Families"):
    # the family's model_type and config keys, its structure (norms, fused projections, caps,
    # windows) at CI size. Each builds in about a second.
    # Qwen3: per-head q/k RMSNorm, head_dim 128 wider than hidden / heads (as Qwen3-0.6B..4B), tied.
    "tiny-qwen3": {
        "model_type": "qwen3",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "intermediate_size": 768,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "vocab_size": 8192,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
    },
    # Mistral: mlx-lm runs model_type mistral with its llama model; GQA 8 / 2, untied.
    "tiny-mistral": {
        "model_type": "mistral",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "intermediate_size": 896,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 8192,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 32768,
    },
    # Phi-3: q|k|v fused into one qkv_proj, gate|up into one gate_up_proj; untied.
    "tiny-phi3": {
        "model_type": "phi3",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "intermediate_size": 704,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 8192,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
    },
    # Gemma 2: four norms a block (1 + weight), GELU MLP, attention and final logit soft-capping,
    # the embedding scaled by sqrt(hidden), tied head, a larger vocabulary.
    "tiny-gemma2": {
        "model_type": "gemma2",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "intermediate_size": 1024,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 16384,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "query_pre_attn_scalar": 64,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 4096,
    },
    # Gemma 3 (text): Gemma 2's block plus per-head q/k norms, sliding-window layers (a window of
    # 16 tokens, layer 0 local, layer 1 global), two RoPE bases, one KV head, tied head.
    "tiny-gemma3": {
        "model_type": "gemma3_text",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "intermediate_size": 1024,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "vocab_size": 16384,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "query_pre_attn_scalar": 64,
        "sliding_window": 16,
        "sliding_window_pattern": 2,
    },
}

# The families a preset may have, by model_type: the tokenizer style and the block's structure.
# ``norm_offset``: the norms compute x * (1 + weight) (Gemma); ``qk_norm``: per-head q/k RMSNorm
# of head_dim weights; ``post_norms``: the block's outputs pass their own norms before the residual
# add (Gemma); ``fused``: q|k|v and gate|up are one matrix each (Phi-3); ``embed_scale``: the
# embedding's output is multiplied by sqrt(hidden); ``bias``: q/k/v biases (Qwen2).
FAMILIES = {
    "qwen2": {"style": "qwen2", "arch": "Qwen2ForCausalLM", "bias": True},
    "llama": {"style": "llama", "arch": "LlamaForCausalLM"},
    "qwen3": {"style": "qwen2", "arch": "Qwen3ForCausalLM", "qk_norm": True},
    "mistral": {"style": "mistral", "arch": "MistralForCausalLM"},
    "phi3": {"style": "phi3", "arch": "Phi3ForCausalLM", "fused": True},
    "gemma2": {"style": "gemma", "arch": "Gemma2ForCausalLM", "norm_offset": True, "post_norms": True,
               "embed_scale": True},
    "gemma3_text": {"style": "gemma", "arch": "Gemma3ForCausalLM", "norm_offset": True, "post_norms": True,
                    "embed_scale": True, "qk_norm": True},
}

QUANT_SUFFIX = "-4bit"
QUANT_GROUP_SIZE = 64
QUANT_BITS = 4

# Pre-tokenizer regexes of the real Qwen2 and Llama 3 tokenizers.
QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{%- else %}{{- ' ' + message['content'] | trim + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
PHI3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)
GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

# Tokenizer flavours (special tokens sit at the top of the vocabulary), named by FAMILIES' style.
TOKENIZER_STYLES = {
    "qwen2": {
        "regex": QWEN2_REGEX,
        "nfc": True,
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None,
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "stop": ["<|im_end|>", "<|endoftext|>"],
        "chat_template": CHATML_TEMPLATE,
        "tokenizer_class": "Qwen2Tokenizer",
    },
    "llama": {
        "regex": LLAMA3_REGEX,
        "nfc": False,
        "special": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "pad": None,
        "stop": ["<|eot_id|>", "<|end_of_text|>"],
        "chat_template": LLAMA3_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    },
    # Mistral, Phi-3 and Gemma ship SentencePiece tokenizers; these presets stand in a byte-level
    # BPE (the Llama 3 regex) with the family's special tokens, chat template and bos/eos.
    "mistral": {
        "regex": LLAMA3_REGEX,
        "nfc": False,
        "special": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        "bos": "<s>",
        "eos": "</s>",
        "pad": None,
        "stop": ["</s>"],
        "chat_template": MISTRAL_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    },
    "phi3": {
        "regex": LLAMA3_REGEX,
        "nfc": False,
        "special": ["<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        "bos": None,
        "eos": "<|endoftext|>",
        "pad": "<|endoftext|>",
        "stop": ["<|end|>", "<|endoftext|>"],
        "chat_template": PHI3_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    },
    "gemma": {
        "regex": LLAMA3_REGEX,
        "nfc": False,
        "special": ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        "bos": "<bos>",
        "eos": "<eos>",
        "pad": "<pad>",
        "stop": ["<end_of_turn>", "<eos>"],
        "chat_template": GEMMA_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    },
}


def family(model_type):
    """FAMILIES' entry of ``model_type`` (ValueError naming the known ones for any other)."""
    if model_type not in FAMILIES:
        raise ValueError(f"synthetic models of model_type {model_type!r} are not built; known: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]

TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
]


def parse_preset(name):
    """``'tiny-4bit'`` -> ``('tiny', True)``; unknown names raise ValueError."""
    base = name.removesuffix(QUANT_SUFFIX)
    if base not in PRESETS:
        allowed = ", ".join(PRESETS)
        raise ValueError(
            f"unknown synth preset {name!r}; choose one of: {allowed} "
            f"(optionally with the {QUANT_SUFFIX!r} suffix, e.g. 'tiny{QUANT_SUFFIX}')"
        )
    return base, name != base


def make_config(preset):
    p = PRESETS[preset]
    fam = family(p["model_type"])
    style = TOKENIZER_STYLES[fam["style"]]
    special = special_token_ids(p["vocab_size"], style)
    common = {
        "architectures": [fam["arch"]],
        "attention_dropout": 0.0,
        "hidden_act": "gelu_pytorch_tanh" if fam.get("norm_offset") else "silu",
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "bos_token_id": special[style["bos"] or style["pad"]],
        "eos_token_id": special[style["eos"]],
    }
    if p["model_type"] == "qwen2":
        extra = {
            "max_window_layers": p["num_hidden_layers"],
            "sliding_window": p["max_position_embeddings"],
            "use_sliding_window": False,
        }
    elif p["model_type"] == "llama":
        extra = {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    elif p["model_type"] == "qwen3":
        extra = {"attention_bias": False, "max_window_layers": p["num_hidden_layers"], "sliding_window": None,
                 "use_sliding_window": False}
    elif p["model_type"] == "mistral":
        extra = {"sliding_window": None}
    elif p["model_type"] == "phi3":
        extra = {"embd_pdrop": 0.0, "resid_pdrop": 0.0, "rope_scaling": None, "sliding_window": None,
                 "pad_token_id": special[style["pad"]]}
    else:  # gemma2, gemma3_text
        extra = {"hidden_activation": "gelu_pytorch_tanh", "pad_token_id": special[style["pad"]],
                 "attention_bias": False}
    return dict(sorted({**common, **extra, **p}.items()))


def attention_head_dim(config):
    """Per-head width: ``head_dim`` where the config gives one (Qwen3), else hidden / heads."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def param_count(config):
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    fam = family(config["model_type"])
    head_dim = attention_head_dim(config)
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    attn = h * q + 2 * h * kv + q * h
    if fam.get("bias"):
        attn += q + 2 * kv
    if fam.get("qk_norm"):
        attn += 2 * head_dim
    layer = attn + 3 * h * i + (4 if fam.get("post_norms") else 2) * h
    heads = 1 if config["tie_word_embeddings"] else 2
    return config["num_hidden_layers"] * layer + heads * v * h + h


# ---------------------------------------------------------------------------------------------
# Tokenizer


def special_token_ids(vocab_size, style):
    n = len(style["special"])
    return {tok: vocab_size - n + k for k, tok in enumerate(style["special"])}


def _pre_tokenizer(style):
    from tokenizers import Regex, normalizers, pre_tokenizers

    split = pre_tokenizers.Split(Regex(style["regex"]), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    normalizer = normalizers.NFC() if style["nfc"] else None
    return normalizer, pre_tokenizers.Sequence([split, byte_level])


@functools.lru_cache(maxsize=None)
def train_bpe(style_name):
    """Train the byte-level BPE on the shipped corpus; returns ``(vocab, merges)``.

    Training is deterministic (ties between equally frequent pairs break by pair id), and the
    corpus only supports a few thousand merges, so the result does not depend on vocab size.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    style = TOKENIZER_STYLES[style_name]
    tok = Tokenizer(models.BPE())
    normalizer, tok.pre_tokenizer = _pre_tokenizer(style)
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=1 << 20,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(DATA / "corpus.txt")], trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def filler_tokens(n, taken):
    """``n`` pseudo-words in the byte-level alphabet that are not in ``taken``.

    No merge produces them, so encoding never yields their ids, but they decode to text
    (``'Ġ'`` is the byte-level form of a space).
    """
    rng = random.Random(0)
    onsets = "b c d f g h j k l m n p r s t v w z br ch dr fl gr kl pr sh st th tr".split()
    vowels = "a e i o u ai ea ou".split()
    out, seen = [], set(taken)
    while len(out) < n:
        word = "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(2, 4)))
        if rng.random() < 0.15:
            word = word.capitalize()
        if rng.random() < 0.85:
            word = "Ġ" + word
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out


def build_tokenizer(model_type, vocab_size):
    """A ``tokenizers.Tokenizer`` with exactly ``vocab_size`` ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    style_name = family(model_type)["style"]
    style = TOKENIZER_STYLES[style_name]
    vocab, merges = train_bpe(style_name)
    n_regular = vocab_size - len(style["special"])
    if n_regular < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the trained BPE ({len(vocab)})")
    vocab = dict(vocab)
    for word in filler_tokens(n_regular - len(vocab), vocab):
        vocab[word] = len(vocab)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    normalizer, tok.pre_tokenizer = _pre_tokenizer(style)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in style["special"]])
    bos = style["bos"]
    if bos is not None:  # Llama 3 prepends <|begin_of_text|> when encoding (Mistral <s>, Gemma <bos>)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def write_tokenizer(config, out_dir):
    model_type, vocab_size = config["model_type"], config["vocab_size"]
    style = TOKENIZER_STYLES[family(model_type)["style"]]
    tok = build_tokenizer(model_type, vocab_size)
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    ids = special_token_ids(vocab_size, style)
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in style["special"]
    }
    special_map = {"bos_token": style["bos"], "eos_token": style["eos"], "pad_token": style["pad"]}
    tok_config = {
        "added_tokens_decoder": added,
        "chat_template": style["chat_template"],
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": style["tokenizer_class"],
        "unk_token": None,
        **special_map,
    }
    if family(model_type)["style"] == "qwen2":
        tok_config["errors"] = "replace"
        tok_config["split_special_tokens"] = False
    generation = {
        "bos_token_id": ids[style["bos"] or style["pad"]],
        "eos_token_id": [ids[t] for t in style["stop"]],
        "do_sample": False,
    }
    if style["pad"] is not None:
        generation["pad_token_id"] = ids[style["pad"]]
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    _write_json(out_dir / "special_tokens_map.json", {k: v for k, v in special_map.items() if v})
    _write_json(out_dir / "generation_config.json", generation)


# ---------------------------------------------------------------------------------------------
# Weights

# Embedding entries ~0.02, as in real checkpoints.
EMBED_STD = 0.02
# Residual-branch gain, in units of EMBED_STD: a unit-RMS input to o_proj/down_proj gives an
# output RMS of about BLOCK_GAIN * EMBED_STD / sqrt(2 * layers). Each block is then a small update
# to the residual stream (all blocks together about half the embedding's RMS), so a few percent
# weight error in one layer is a small perturbation of the logits, as in trained models.
BLOCK_GAIN = 0.35
# Logit std (the final norm weight sets it): next-token entropy about 2.2 nats (tiny) to 2.9
# (qwen2.5-0.5b), the range of real models on ordinary text.
LOGIT_STD = 2.75
# Student-t degrees of freedom of the bulk weights: excess kurtosis 3, between Gaussian and the
# heaviest rows of real checkpoints.
STUDENT_T_DF = 6.0


@functools.lru_cache(maxsize=None)
def t_quantiles(df=STUDENT_T_DF, n=1 << 16):
    """``n`` equally spaced quantiles of a unit-variance Student-t, for inverse-CDF sampling.

    Looking up 16-bit uniform ints in this table is several times faster than
    ``Generator.standard_t`` and keeps the tails out to about 10 sigma.
    """
    x = np.linspace(-80.0, 80.0, 1_600_001)
    cdf = np.cumsum(np.exp(-(df + 1) / 2 * np.log1p(x * x / df)))
    cdf /= cdf[-1]
    q = np.interp((np.arange(n) + 0.5) / n, cdf, x)
    return (q / np.sqrt(np.mean(q * q))).astype(np.float32)


def tensor_rng(seed, name):
    """An independent PCG64 stream per (seed, tensor name), so order of generation is irrelevant."""
    seq = np.random.SeedSequence([seed, zlib.crc32(name.encode())])
    return np.random.Generator(np.random.PCG64(seq))


def heavy_tailed(rng, shape):
    return t_quantiles()[rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)]


def outlier_scales(rng, n, count, low, high):
    """Per-channel scales: log-normal jitter with ``count`` channels boosted ``low..high`` x."""
    scales = rng.lognormal(0.0, 0.2, n).astype(np.float32)
    channels = np.sort(rng.choice(n, size=count, replace=False))
    scales[channels] *= rng.uniform(low, high, count).astype(np.float32)
    return scales, channels


def linear(rng, out_features, in_features, gain, col_scales):
    """Heavy-tailed weight with log-normal row norms and the given input-channel scales.

    Normalised so a unit-RMS input gives an output RMS of about ``gain``.
    """
    rows = rng.lognormal(0.0, 0.3, out_features).astype(np.float32)
    norm = gain / np.sqrt(in_features * np.mean(col_scales.astype(np.float64) ** 2))
    w = heavy_tailed(rng, (out_features, in_features))
    w *= (rows * np.float32(norm))[:, None]
    w *= col_scales[None, :]
    return w


def layer_tensors(config, seed, i, hidden_outliers):
    """All tensors of decoder layer ``i`` as float32 numpy arrays, named as the family stores them."""
    fam = family(config["model_type"])
    h, inter = config["hidden_size"], config["intermediate_size"]
    n_layers = config["num_hidden_layers"]
    head_dim = attention_head_dim(config)
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    prefix = f"model.layers.{i}."
    rng = tensor_rng(seed, prefix)
    # Residual-branch outputs are small next to the embedding (see BLOCK_GAIN) and shrink with
    # depth, so the blocks together add about the same to the stream at any depth.
    out_gain = BLOCK_GAIN * EMBED_STD / np.sqrt(2.0 * n_layers)
    gains = rng.lognormal(0.0, 0.15, 7)  # per-layer, per-matrix scale variation
    hidden_cols = rng.lognormal(0.0, 0.2, h).astype(np.float32)
    hidden_cols[hidden_outliers] *= rng.uniform(3.0, 8.0, len(hidden_outliers)).astype(np.float32)
    o_cols, _ = outlier_scales(rng, q_dim, max(2, q_dim // 256), 2.0, 5.0)
    down_cols, _ = outlier_scales(rng, inter, max(2, inter // 512), 4.0, 10.0)

    specs = {
        "self_attn.q_proj.weight": (q_dim, h, gains[0], hidden_cols),
        "self_attn.k_proj.weight": (kv_dim, h, gains[1], hidden_cols),
        "self_attn.v_proj.weight": (kv_dim, h, gains[2], hidden_cols),
        "self_attn.o_proj.weight": (h, q_dim, out_gain * gains[3], o_cols),
        "mlp.gate_proj.weight": (inter, h, gains[4], hidden_cols),
        "mlp.up_proj.weight": (inter, h, gains[5], hidden_cols),
        "mlp.down_proj.weight": (h, inter, 2.0 * out_gain * gains[6], down_cols),
    }
    tensors = {}
    for name, (n_out, n_in, gain, cols) in specs.items():
        tensors[prefix + name] = linear(tensor_rng(seed, prefix + name), n_out, n_in, gain, cols)

    # RMSNorm weights: log-normal around 1, a few channels nearly switched off, and small on
    # the outlier channels so their large weight columns do not drown the other inputs.
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        w = rng.lognormal(0.0, 0.3, h).astype(np.float32)
        w[rng.choice(h, size=max(1, h // 64), replace=False)] *= np.float32(0.05)
        w[hidden_outliers] *= rng.uniform(0.05, 0.15, len(hidden_outliers)).astype(np.float32)
        tensors[prefix + name] = w

    if fam.get("bias"):
        # Qwen2 keys carry large per-channel biases: the channel outliers KV-cache quantizers see.
        k_bias = rng.normal(0.0, 0.3, kv_dim).astype(np.float32)
        hot = rng.choice(kv_dim, size=max(2, kv_dim // 32), replace=False)
        k_bias[hot] = rng.choice([-1.0, 1.0], len(hot)) * rng.uniform(2.0, 6.0, len(hot))
        tensors[prefix + "self_attn.q_proj.bias"] = rng.normal(0.0, 0.1, q_dim).astype(np.float32)
        tensors[prefix + "self_attn.k_proj.bias"] = k_bias
        tensors[prefix + "self_attn.v_proj.bias"] = rng.normal(0.0, 0.02, kv_dim).astype(np.float32)
    if fam.get("qk_norm"):  # per-head q/k RMSNorm over head_dim (Qwen3, Gemma 3)
        for name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            tensors[prefix + name] = rng.lognormal(0.0, 0.2, head_dim).astype(np.float32)
    if fam.get("post_norms"):
        # Gemma normalises each block's output before the residual add: these norms, not o_proj's and
        # down_proj's gains, set the update's size. The stream is the embedding times sqrt(hidden)
        # (model_tensors), so the updates keep the other families' ratio to it (BLOCK_GAIN).
        # Gemma's MLP reads pre_feedforward_layernorm (the norm drawn above as the other families'
        # post_attention_layernorm); its post_attention_layernorm is the attention's output norm.
        stream = EMBED_STD * np.sqrt(h)
        tensors[prefix + "pre_feedforward_layernorm.weight"] = tensors.pop(prefix + "post_attention_layernorm.weight")
        for name, gain in (("post_attention_layernorm.weight", out_gain), ("post_feedforward_layernorm.weight", 2.0 * out_gain)):
            tensors[prefix + name] = (gain * stream * rng.lognormal(0.0, 0.15, h)).astype(np.float32)
    if fam.get("fused"):  # Phi-3: one qkv_proj and one gate_up_proj, rows in q|k|v and gate|up order
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        tensors[attn + "qkv_proj.weight"] = np.concatenate([tensors.pop(attn + f"{n}_proj.weight") for n in "qkv"])
        tensors[mlp + "gate_up_proj.weight"] = np.concatenate([tensors.pop(mlp + f"{n}_proj.weight") for n in ("gate", "up")])
    if fam.get("norm_offset"):  # Gemma's norms compute x * (1 + weight): store weight - 1
        for name in [n for n in tensors if n.endswith("norm.weight")]:
            tensors[name] = tensors[name] - np.float32(1.0)
    return tensors


def embedding(rng, vocab_size, hidden, hidden_outliers, std):
    w = heavy_tailed(rng, (vocab_size, hidden))
    rows = rng.lognormal(0.0, 0.25, vocab_size).astype(np.float32) * np.float32(std)
    w *= rows[:, None]
    cols = np.ones(hidden, dtype=np.float32)
    cols[hidden_outliers] = 4.0
    w *= cols[None, :]
    return w


def hidden_outlier_channels(config, seed):
    """Residual-stream channels that are outliers in every layer, as in real LLMs."""
    h = config["hidden_size"]
    rng = tensor_rng(seed, "structure")
    return np.sort(rng.choice(h, size=max(2, h // 128), replace=False))


def model_tensors(config, seed):
    """Yield ``(name, float32 array)`` for every weight, one tensor at a time."""
    h, v = config["hidden_size"], config["vocab_size"]
    hidden_outliers = hidden_outlier_channels(config, seed)
    rng = tensor_rng(seed, "norm")
    # Real checkpoints: embeddings ~0.02 per element, logits spread by a few units; the final
    # norm weight sets the logit scale (LOGIT_STD), like the large final norms of real models,
    # and mutes the outlier channels so they do not pick the next token on their own.
    emb_std = EMBED_STD
    # No local name for the table: the generator would keep its float32 copy (1.6 GB at 4 B
    # parameters) alive until the last tensor is written.
    yield "model.embed_tokens.weight", embedding(tensor_rng(seed, "embed"), v, h, hidden_outliers, emb_std)
    for i in range(config["num_hidden_layers"]):
        yield from layer_tensors(config, seed, i, hidden_outliers).items()
    head_std = emb_std if config["tie_word_embeddings"] else 1.0 / np.sqrt(h)
    offset = np.float32(1.0 if family(config["model_type"]).get("norm_offset") else 0.0)
    final = rng.lognormal(0.0, 0.2, h).astype(np.float32)
    final *= np.float32(LOGIT_STD / (head_std * np.sqrt(h)))
    final[hidden_outliers] *= np.float32(0.1)
    if config["tie_word_embeddings"]:
        # The stream is mostly the current token's embedding, and with a tied head and a positive
        # final norm, E_t . diag(g) . E_t beats every other logit by ~sqrt(hidden) sigma: the model
        # would just repeat its input. Negating half of the channels removes that diagonal, so
        # the embedding part of the logits is a random bigram table and the blocks add context.
        final[rng.permutation(h)[: h // 2]] *= np.float32(-1.0)
    yield "model.norm.weight", final - offset  # Gemma's norm computes x * (1 + weight)
    if not config["tie_word_embeddings"]:
        head = linear(tensor_rng(seed, "lm_head"), v, h, 1.0, np.ones(h, np.float32))
        yield "lm_head.weight", head


def to_bfloat16(x):
    import mlx.core as mx

    return mx.array(x).astype(mx.bfloat16)


def write_weights(config, seed, out_dir):
    """Write ``model.safetensors`` in bfloat16, like real checkpoints."""
    import mlx.core as mx

    weights = {}
    for name, value in model_tensors(config, seed):
        weights[name] = to_bfloat16(value)
        mx.eval(weights[name])
    save_safetensors(out_dir / "model.safetensors", weights, metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# Build


def quantize_dir(src, dst, group_size=QUANT_GROUP_SIZE, bits=QUANT_BITS):
    """mlx-community style affine quantization of the model in ``src`` into ``dst``."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(src, lazy=True)
    model, config = quantize_model(model, config, group_size, bits)
    save_model(dst, model, donate_model=True)
    save_config(config, config_path=dst / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, dst / name)


def build(preset, out_dir, seed=0):
    """Write the synthetic model ``preset`` (e.g. ``'tiny'``, ``'tiny-4bit'``) into ``out_dir``.

    Returns a JSON-able description: preset, seed, parameter count, outlier channels.
    """
    base, quantized = parse_preset(preset)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = make_config(base)
    if quantized:
        with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.base-") as tmp:
            info = build(base, tmp, seed)
            quantize_dir(Path(tmp), out_dir)
        quantization = {"group_size": QUANT_GROUP_SIZE, "bits": QUANT_BITS, "mode": "affine"}
        return {**info, "preset": preset, "quantization": quantization}

    _write_json(out_dir / "config.json", config)
    write_tokenizer(config, out_dir)
    write_weights(config, seed, out_dir)
    return {
        "preset": preset,
        "seed": seed,
        "model_type": config["model_type"],
        "parameters": param_count(config),
        "hidden_outlier_channels": [int(c) for c in hidden_outlier_channels(config, seed)],
        "tokenizer_bpe_tokens": len(train_bpe(family(config["model_type"])["style"])[0]),
    }


def _write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv=None):
    """Time preset builds: ``python -m vqpipe.sources.synth [PRESET ...]`` (default: all presets)."""
    for name in (sys.argv[1:] if argv is None else argv) or PRESETS:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            info = build(name, Path(tmp) / name)
            seconds = time.perf_counter() - start
            print(f"{name}: {info['parameters'] / 1e6:.1f}M parameters, built in {seconds:.1f} s")


if __name__ == "__main__":
    main()
