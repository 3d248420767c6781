"""A GGUF's byte-level BPE tokenizer (``tokenizer.ggml.*``) -> tokenizer.json + tokenizer_config.json.

llama.cpp names the pre-tokenizer (``tokenizer.ggml.pre``); we rebuild the same splitting with the
``tokenizers`` components the original Hugging Face tokenizers use.
"""

import json

from .gguf_check import TOKEN_CONTROL, TOKEN_USER_DEFINED, field
from .synth import LLAMA3_REGEX, QWEN2_REGEX

# GPT-2's split regex (what ByteLevel(use_regex=True) applies).
GPT2_PRE = ("gpt2", "default")
# llama.cpp's SmolLM/StarCoder family: single digits first, then the GPT-2 regex.
DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell")
REGEX_PRE = {"qwen2": QWEN2_REGEX, "llama-bpe": LLAMA3_REGEX}
PRE_TYPES = GPT2_PRE + DIGITS_PRE + tuple(REGEX_PRE)


def pre_tokenizer(pre):
    from tokenizers import Regex, normalizers, pre_tokenizers

    if pre in GPT2_PRE:
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGITS_PRE:
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in REGEX_PRE:
        split = pre_tokenizers.Split(Regex(REGEX_PRE[pre]), behavior="isolated", invert=False)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        normalizer = normalizers.NFC() if pre == "qwen2" else None
        return normalizer, pre_tokenizers.Sequence([split, byte_level])
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TYPES)}")


def build(reader):
    """(tokenizers.Tokenizer, info) from the GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors


    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2', byte-level BPE)")
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF tokenizer has duplicate tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    types = list(field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    pre = field(reader, "tokenizer.ggml.pre", "default")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    normalizer, tok.pre_tokenizer = pre_tokenizer(pre)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(types) if t == TOKEN_CONTROL]
    user = [tokens[i] for i, t in enumerate(types) if t == TOKEN_USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    bos_id = field(reader, "tokenizer.ggml.bos_token_id", None)
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    byte_level = processors.ByteLevel(trim_offsets=False)
    if add_bos:
        bos = tokens[int(bos_id)]
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, int(bos_id))])
        tok.post_processor = processors.Sequence([byte_level, template])
    else:
        tok.post_processor = byte_level
    info = {"model": kind, "pre": pre, "vocab": len(tokens), "merges": len(merges),
            "special_tokens": len(special), "user_tokens": len(user), "add_bos_token": add_bos}
    return tok, info


def special_name(reader, tokens, key):

    i = field(reader, f"tokenizer.ggml.{key}_token_id", None)
    return None if i is None or int(i) >= len(tokens) else tokens[int(i)]


def write_tokenizer(reader, config, dst):
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json."""

    tok, info = build(reader)
    tok.save(str(dst / "tokenizer.json"))
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    names = {k: special_name(reader, tokens, k) for k in ("bos", "eos", "padding", "unknown")}
    special_map = {"bos_token": names["bos"], "eos_token": names["eos"],
                   "pad_token": names["padding"], "unk_token": names["unknown"]}
    added = {str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": t.special}
             for i, t in sorted(tok.get_added_tokens_decoder().items())}
    template = field(reader, "tokenizer.chat_template", None)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "add_bos_token": info["add_bos_token"],
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        **special_map,
    }
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "do_sample": False}
    if names["padding"] is not None:
        generation["pad_token_id"] = tokens.index(names["padding"])
    for name, obj in (("tokenizer_config.json", tok_config), ("generation_config.json", generation),
                      ("special_tokens_map.json", {k: v for k, v in special_map.items() if v})):
        (dst / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return {**info, "chat_template": template is not None}
