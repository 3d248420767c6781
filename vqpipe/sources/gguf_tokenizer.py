"""A GGUF's tokenizer (``tokenizer.ggml.*``) -> tokenizer.json + tokenizer_config.json.

Two of llama.cpp's tokenizer models are rebuilt with ``tokenizers`` components:

``gpt2``, byte-level BPE with the file's merges: llama.cpp names the pre-tokenizer
(``tokenizer.ggml.pre``); we rebuild the same splitting with the components the original Hugging
Face tokenizers use.

``llama``, a SentencePiece vocabulary (Llama 2, Mistral, Gemma): pieces and scores, no merges.
llama.cpp writes spaces as "▁", puts a "▁" before each text fragment (the start of the text and
after each added token) when ``add_space_prefix``, then repeatedly merges the adjacent pair whose
concatenation is the best-scoring piece (leftmost on a tie) and spells what is left outside the
vocabulary as byte pieces ``<0xNN>``. A BPE model does the same with merges derived from the
vocabulary: every split of a piece into two pieces, ranked by the piece's score, and byte fallback.
Only normal and user-defined pieces take part in merges, as in sentencepiece: llama.cpp would also
merge into a control or unused piece, but only if both halves were pieces, which real vocabularies
(``<pad>``, ``<start_of_turn>``, ``<unused7>``) never have. Control and unknown pieces are special
added tokens, user-defined ones plain added tokens, split out of the raw text first as llama.cpp
does (so with ``add_space_prefix`` the text after one gets a "▁", where sentencepiece puts one only
at the start).

Two corners differ from llama.cpp. Overlapping candidate pairs of equal score (two pieces of one
score, or two splits of one piece as in ``ab|a|ba``) go to the lower merge rank, not the left pair;
sentencepiece's trainer gives every merged piece its own score, so only the second can occur in its
vocabularies. A character that is not a piece becomes bytes before merging instead of after, which
matters only if some piece contains it, and a trained vocabulary holds every character of its pieces.
"""

import json

from .gguf_check import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED, field
from .synth import LLAMA3_REGEX, QWEN2_REGEX

# GPT-2's split regex (what ByteLevel(use_regex=True) applies).
GPT2_PRE = ("gpt2", "default")
# llama.cpp's SmolLM/StarCoder family: single digits first, then the GPT-2 regex.
DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell")
# llama.cpp's names for Llama 3's and Qwen 2's splitting (DeepSeek-R1's Qwen distills keep Qwen's).
LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")
QWEN2_PRE = ("qwen2", "deepseek-r1-qwen")
# Mistral's Tekken (Mistral NeMo, Pixtral, later Mistral models) and OpenAI's o200k splitting (Phi-4,
# Llama 4): words split at a lower-to-upper case change, Tekken's digits one by one, o200k's up to
# three with English contractions kept on their word. These are the models' own tokenizer.json
# regexes; llama.cpp runs a rewrite of them that is the same on ASCII text but counts every
# non-ASCII letter as upper case (its regex engine has no \p{Lu}), so the two can split an accented
# word differently.
TEKKEN_PRE = ("tekken",)
GPT4O_PRE = ("gpt-4o", "llama4")
TEKKEN_REGEX = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
    r"""|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
GPT4O_REGEX = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
REGEX_PRE = {**{p: QWEN2_REGEX for p in QWEN2_PRE}, **{p: LLAMA3_REGEX for p in LLAMA3_PRE},
             **{p: TEKKEN_REGEX for p in TEKKEN_PRE}, **{p: GPT4O_REGEX for p in GPT4O_PRE}}
PRE_TYPES = GPT2_PRE + DIGITS_PRE + tuple(REGEX_PRE)
# llama.cpp's ignore_merges (a word that is itself a token is taken whole) and its bos default where
# the file has no tokenizer.ggml.add_bos_token: both for Llama 3's and Tekken's names
WHOLE_WORDS_PRE = LLAMA3_PRE + TEKKEN_PRE


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
        normalizer = normalizers.NFC() if pre in QWEN2_PRE else None
        return normalizer, pre_tokenizers.Sequence([split, byte_level])
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TYPES)}")


def vocabulary(reader):
    """(tokens, {token: id}, token types) of the GGUF vocabulary."""
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF tokenizer has duplicate tokens")
    types = list(field(reader, "tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens)))
    if len(types) != len(tokens):
        raise ValueError(f"GGUF tokenizer has {len(types)} token types for {len(tokens)} tokens")
    return tokens, vocab, types


def add_tokens(tok, tokens, types, special_types):
    """Tokens of ``special_types`` as special added tokens, user-defined ones as plain added tokens."""
    from tokenizers import AddedToken

    special = [tokens[i] for i, t in enumerate(types) if t in special_types]
    user = [tokens[i] for i, t in enumerate(types) if t == TOKEN_USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return special, user


def build(reader):
    """(tokenizers.Tokenizer, info) from the GGUF metadata."""
    kind = field(reader, "tokenizer.ggml.model")
    if kind == "gpt2":
        return build_gpt2(reader)
    if kind == "llama":
        return build_spm(reader)
    raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; "
                     "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece)")


def build_gpt2(reader):
    from tokenizers import Tokenizer, decoders, models, processors

    tokens, vocab, types = vocabulary(reader)
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    pre = field(reader, "tokenizer.ggml.pre", "default")

    # Llama 3's and Tekken's splitting take a word that is itself a token whole, whatever the merges
    # would make of it (llama.cpp's ignore_merges; their own tokenizer.json files say the same)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in WHOLE_WORDS_PRE))
    normalizer, tok.pre_tokenizer = pre_tokenizer(pre)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    special, user = add_tokens(tok, tokens, types, (TOKEN_CONTROL,))

    bos_id = field(reader, "tokenizer.ggml.bos_token_id", None)
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", pre in WHOLE_WORDS_PRE)) and bos_id is not None
    byte_level = processors.ByteLevel(trim_offsets=False)
    if add_bos:
        bos = tokens[int(bos_id)]
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, int(bos_id))])
        tok.post_processor = processors.Sequence([byte_level, template])
    else:
        tok.post_processor = byte_level
    info = {"model": "gpt2", "pre": pre, "vocab": len(tokens), "merges": len(merges),
            "special_tokens": len(special), "user_tokens": len(user), "add_bos_token": add_bos}
    return tok, info


# Pieces a merge may produce or consume: sentencepiece keeps control, unknown, byte and unused
# pieces out of its merge table.
MERGEABLE = (TOKEN_NORMAL, TOKEN_USER_DEFINED)


def spm_merges(tokens, scores, types):
    """BPE merges equivalent to SentencePiece's best-score-first merging of this vocabulary.

    Every split of a mergeable piece into two mergeable pieces, ranked by the piece's score (higher
    first), then its id, then the left half's id.
    """
    ids = {t: i for i, t in enumerate(tokens) if types[i] in MERGEABLE}
    ranked = []
    for piece, i in ids.items():
        for k in range(1, len(piece)):
            left = ids.get(piece[:k])
            if left is not None and piece[k:] in ids:
                ranked.append((-scores[i], i, left, k))
    ranked.sort()
    return [(tokens[i][:k], tokens[i][k:]) for _, i, _, k in ranked]


def token_id(reader, tokens, key):
    """``tokenizer.ggml.{key}_token_id``, None when absent."""
    i = field(reader, f"tokenizer.ggml.{key}_token_id", None)
    if i is not None and not 0 <= int(i) < len(tokens):
        raise ValueError(f"GGUF tokenizer.ggml.{key}_token_id {int(i)} is outside the vocabulary of {len(tokens)}")
    return None if i is None else int(i)


def end_token(reader, tokens, key, default):
    """(token, id) of ``key`` (bos, eos) when llama.cpp adds it around the text, else None."""
    i = token_id(reader, tokens, key)
    add = bool(field(reader, f"tokenizer.ggml.add_{key}_token", default))
    return (tokens[i], i) if add and i is not None else None


def spm_processor(bos, eos):
    """Puts ``bos`` and ``eos`` ((token, id) or None) around each sequence, as llama.cpp does."""
    from tokenizers import processors

    def wrap(seq, n):
        return ([f"{bos[0]}:{n}"] if bos else []) + [f"${seq}:{n}"] + ([f"{eos[0]}:{n}"] if eos else [])

    specials = dict(t for t in (bos, eos) if t)
    return processors.TemplateProcessing(single=wrap("A", 0), pair=wrap("A", 0) + wrap("B", 1),
                                         special_tokens=list(specials.items()))


def build_spm(reader):
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens, vocab, types = vocabulary(reader)
    scores = [float(x) for x in field(reader, "tokenizer.ggml.scores")]
    if len(scores) != len(tokens):
        raise ValueError(f"GGUF tokenizer has {len(scores)} scores for {len(tokens)} tokens")
    merges = spm_merges(tokens, scores, types)
    unk_id = token_id(reader, tokens, "unknown")
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(types) if t == TOKEN_UNKNOWN), None)
    prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))

    unk = None if unk_id is None else tokens[unk_id]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    normalize = [normalizers.Replace(" ", "▁")]
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        # Prepend applies to every fragment between added tokens, as llama.cpp's space prefix does.
        normalize = [normalizers.Prepend("▁"), *normalize]
        decode.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(normalize)
    tok.decoder = decoders.Sequence(decode)
    special, user = add_tokens(tok, tokens, types, (TOKEN_CONTROL, TOKEN_UNKNOWN))
    # llama.cpp's defaults for SentencePiece: BOS on, EOS off.
    bos, eos = end_token(reader, tokens, "bos", True), end_token(reader, tokens, "eos", False)
    if bos or eos:
        tok.post_processor = spm_processor(bos, eos)
    info = {"model": "llama", "vocab": len(tokens), "merges": len(merges), "special_tokens": len(special),
            "user_tokens": len(user), "add_bos_token": bool(bos), "add_eos_token": bool(eos),
            "add_space_prefix": prefix}
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
        **({"add_eos_token": info["add_eos_token"]} if "add_eos_token" in info else {}),
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
