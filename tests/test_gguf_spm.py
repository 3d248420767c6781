"""gguf: tokenizer of SentencePiece vocabularies (tokenizer.ggml.model "llama": Gemma 3, Llama 2, Mistral).

A small sentencepiece BPE model is trained here, written into a GGUF the way llama.cpp's converter
writes one, rebuilt with vqpipe.sources.gguf_tokenizer and compared id for id with sentencepiece's
own encoder. What guards what:
- merges ranked by score: the GGUF numbers the normal pieces in reverse score order (sentencepiece's
  trainer numbers them in score order), so merges ranked by token id split words differently and
  test_matches_sentencepiece fails on almost every line;
- byte fallback: CJK, emoji, tabs and newlines (absent from the training lines, unlike the corpus's
  accented letters) come out as <0xNN> pieces; without byte fallback they become <unk> and the same
  test fails (test_byte_fallback_and_space_prefix checks that they really are bytes);
- the space prefix: the Gemma-like case has none, the Llama-like one gets it from llama.cpp's default.

One deliberate difference from sentencepiece: with a space prefix, llama.cpp (and so this tokenizer)
puts a "▁" before every text fragment after an added token, sentencepiece only at the start of the
text. Texts with added tokens are therefore compared with llama.cpp's rule, each fragment encoded
by sentencepiece on its own (``reference``), and, without a space prefix, also with sentencepiece
whole.
"""

import io
import random
import re
from pathlib import Path

import numpy as np
import pytest

spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

import vqpipe  # noqa: E402
from vqpipe.sources.gguf_tokenizer import build, spm_merges, write_tokenizer  # noqa: E402

CORPUS = Path(vqpipe.__file__).parent / "data" / "corpus.txt"
USER = ["<tag>", "@@"]
UNK, BOS, EOS, PAD = 0, 1, 2, 3
# llama_token_type
NORMAL, UNKNOWN, CONTROL_T, USER_T, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
CASES = {
    # Gemma 3: no space prefix; pieces may span spaces (runs of "▁", "s▁of")
    "gemma": dict(add_dummy_prefix=False, split_by_whitespace=False),
    # Llama 2 / Mistral: a space prefix, pieces start at a space
    "llama": dict(add_dummy_prefix=True, split_by_whitespace=True),
}
EDGE = [
    "", " ", "  ", "   three leading", "trailing   ", "a  b   c    d     e", "\n", "\n\n",
    "line one\nline two\n\n  indented", "\ttab\tseparated\t", "\r\n", "12345 67.89 1,000,000 -12 °C",
    "Hello, world! (a) [b] {c} 'e' \"f\"?;: x=y+z*2/3 #!",
    "café naïve résumé Ångström ÿ", "中文 日本語 한국어", "emoji 😀🎉 mixed 👩‍👩‍👧", "\u00a0no-break \u200bzero width",
    "the the the the", "aaaaaaaaaaaaaaa", "                                ",
]
WITH_ADDED = [
    "a<tag>b", "x <tag> y", "@@start and end@@", "<tag><tag>", "  <tag>  ", "<tag>", "q@@@r",
    "<s>hi</s>", "<s> hi </s><pad>", "</s>", "no<unk>way",
]


def token_type(sp, i):
    if sp.is_unknown(i):
        return UNKNOWN
    if sp.is_control(i):
        return CONTROL_T
    if sp.is_byte(i):
        return BYTE
    if sp.is_unused(i):
        return UNUSED
    return USER_T if sp.id_to_piece(i) in USER else NORMAL


def train(tmp_path, **options):
    lines = CORPUS.read_text(encoding="utf-8").split("\n")
    seen = tmp_path / "seen.txt"
    seen.write_text("\n".join(lines[: len(lines) // 2]), encoding="utf-8")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=str(seen), model_writer=model, model_type="bpe", vocab_size=1000, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, user_defined_symbols=USER, character_coverage=1.0,
        unk_id=UNK, bos_id=BOS, eos_id=EOS, pad_id=PAD, minloglevel=2, **options)
    return spm.SentencePieceProcessor(model_proto=model.getvalue()), lines


def write_gguf(path, pieces, scores, types, model="llama", **flags):
    """Metadata as llama.cpp's converter writes it for a SentencePiece vocabulary, and one tensor."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_unk_token_id(UNK)
    w.add_pad_token_id(PAD)
    for key, value in flags.items():  # add_bos_token, add_eos_token, add_space_prefix
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((len(pieces), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


class Case:
    """A trained sentencepiece model and its GGUF, whose normal pieces are numbered in reverse."""

    def __init__(self, tmp_path, name, **flags):
        self.name = name
        self.sp, lines = train(tmp_path, **CASES[name])
        half = len(lines) // 2
        self.seen, self.unseen = lines[:half], lines[half:]
        n = self.sp.get_piece_size()
        types = [token_type(self.sp, i) for i in range(n)]
        normal = [i for i in range(n) if types[i] == NORMAL]
        order = list(range(n))  # GGUF id -> sentencepiece id
        for dst, src in zip(normal, reversed(normal)):
            order[dst] = src
        self.to_gguf = {s: g for g, s in enumerate(order)}
        self.pieces = [self.sp.id_to_piece(i) for i in order]
        self.vocab = {p: i for i, p in enumerate(self.pieces)}
        self.added = [self.sp.id_to_piece(i) for i in range(n) if types[i] in (UNKNOWN, CONTROL_T, USER_T)]
        self.reader = write_gguf(tmp_path / f"{name}.gguf", self.pieces, [self.sp.get_score(i) for i in order],
                                 [types[i] for i in order], **flags)
        self.tok, self.info = build(self.reader)

    def sp_ids(self, text):
        return [self.to_gguf[i] for i in self.sp.encode(text)]

    def ids(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def reference(self, text):
        """llama.cpp: added tokens split out first, then each text fragment encoded on its own."""
        split = re.compile("|".join(re.escape(t) for t in sorted(self.added, key=len, reverse=True)))
        ids, pos = [], 0
        for m in split.finditer(text):
            ids += self.sp_ids(text[pos:m.start()]) + [self.vocab[m.group()]]
            pos = m.end()
        return ids + self.sp_ids(text[pos:])


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma":
        return Case(tmp, "gemma", add_bos_token=True, add_space_prefix=False)
    return Case(tmp, "llama")  # no add_bos_token / add_space_prefix: llama.cpp's defaults (both true)


def fuzz(case, n=2000, seed=0):
    """Strings of random normal pieces, spaces, newlines, tabs, digits and characters outside the vocabulary."""
    rng = random.Random(seed)
    normal = [p.replace("▁", " ") for p in case.pieces
              if len(p) > 1 and p not in case.added and not p.startswith("<0x")]
    extra = list(" \n\t  aé中😀0123456789.,") + ["  ", "   "]
    return ["".join(rng.choice(normal) if rng.random() < 0.7 else rng.choice(extra)
                    for _ in range(rng.randint(1, 12))) for _ in range(n)]


def test_matches_sentencepiece(case):
    texts = case.seen + case.unseen + EDGE + fuzz(case)
    seen = set(case.seen)
    assert sum(t not in seen for t in case.unseen) > 1000  # text the model was not trained on
    wrong = [t for t in texts if case.ids(t) != case.sp_ids(t)]
    assert wrong == [], f"{len(wrong)} of {len(texts)} texts differ, e.g. {wrong[:3]!r}"
    assert case.info["merges"] > 700
    assert case.info == {"model": "llama", "vocab": 1000, "merges": case.info["merges"], "special_tokens": 4,
                         "user_tokens": 2, "add_bos_token": True, "add_eos_token": False,
                         "add_space_prefix": case.name == "llama"}


def test_byte_fallback_and_space_prefix(case):
    """The edge texts really go through byte pieces, and the prefix is where llama.cpp puts it."""
    pieces = lambda text: [case.pieces[i] for i in case.ids(text)]  # noqa: E731
    assert pieces("中") == ["▁"] * (case.name == "llama") + ["<0xE4>", "<0xB8>", "<0xAD>"]
    assert "<0x0A>" in pieces("a\nb")
    assert pieces("a<tag>b")[1:] == ["<tag>", "▁b" if case.name == "llama" else "b"]


def test_added_tokens(case):
    for text in WITH_ADDED:
        assert case.ids(text) == case.reference(text), text
        if case.name == "gemma" and not any(t in text for t in case.added if t not in USER):
            assert case.ids(text) == case.sp_ids(text), text  # user-defined symbols: sentencepiece agrees
    assert case.ids("<s></s><pad><unk>") == [BOS, EOS, PAD, UNK]  # control tokens are single ids
    assert case.ids("@@") == [case.vocab["@@"]]


def test_decode(case):
    for text in case.seen[:300] + case.unseen[:300] + EDGE + fuzz(case, 300, seed=1):
        ids = case.ids(text)
        assert case.tok.decode(ids) == text
        assert case.tok.decode(ids) == case.sp.decode(case.sp.encode(text))
    assert case.tok.decode(case.ids("<s>hi</s>"), skip_special_tokens=False) == (
        "<s> hi</s>" if case.name == "llama" else "<s>hi</s>")


def test_bos(case):
    assert case.tok.encode("hi").ids == [BOS] + case.sp_ids("hi")
    assert case.tok.encode("").ids == [BOS]


def test_write_tokenizer_loads_in_transformers(case, tmp_path):
    from transformers import AutoTokenizer

    info = write_tokenizer(case.reader, {"max_position_embeddings": 128, "bos_token_id": BOS,
                                         "eos_token_id": EOS}, tmp_path)
    assert info["model"] == "llama" and info["chat_template"] is False
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    text = case.unseen[7] + " 中文\n"
    assert tok.encode(text) == [BOS] + case.sp_ids(text)
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")


def test_bos_off_eos_on(tmp_path):
    sp, _ = train(tmp_path, add_dummy_prefix=True)
    n = sp.get_piece_size()
    reader = write_gguf(tmp_path / "m.gguf", [sp.id_to_piece(i) for i in range(n)],
                        [sp.get_score(i) for i in range(n)], [token_type(sp, i) for i in range(n)],
                        add_bos_token=False, add_eos_token=True, add_space_prefix=True)
    tok, info = build(reader)
    assert (info["add_bos_token"], info["add_eos_token"]) == (False, True)
    assert tok.encode("hello there").ids == sp.encode("hello there") + [EOS]


def test_merge_ranking():
    """Score, not id, ranks merges; byte, control and unused pieces take no part; ties go to the lower id.

    sentencepiece and llama.cpp break a tie between two overlapping candidate pairs of equal score
    by position (leftmost); a BPE merge list can only rank them. The trained vocabularies above have
    no such tie (each merged piece has its own score), so this is the one corner not compared.
    """
    tokens = ["<unk>", "<s>", "<0x61>", "<pad>", "a", "b", "c", "bc", "ab", "abc", "<p", "ad>", "cab"]
    scores = [0, 0, 0, 0, -9, -9, -9, -3, -1, -2, -5, -5, -2]
    types = [UNKNOWN, CONTROL_T, BYTE, UNUSED] + [NORMAL] * 9
    assert spm_merges(tokens, scores, types) == [
        ("a", "b"), ("a", "bc"), ("ab", "c"), ("c", "ab"), ("b", "c")]  # no ("<p", "ad>"): "<pad>" is unused


def test_unsupported_model_and_missing_scores(tmp_path):
    reader = write_gguf(tmp_path / "bert.gguf", ["<unk>", "<s>", "</s>", "<pad>", "a"], [0.0] * 5,
                        [UNKNOWN, CONTROL_T, CONTROL_T, CONTROL_T, NORMAL], model="bert")
    with pytest.raises(ValueError, match=r"model 'bert' is not supported; supported: 'gpt2'.*'llama'"):
        build(reader)
    w = gguf.GGUFWriter(str(tmp_path / "noscores.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "a"])
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'tokenizer.ggml.scores' is missing"):
        build(gguf.GGUFReader(str(tmp_path / "noscores.gguf")))
