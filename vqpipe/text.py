"""Real English text for evaluation and calibration: Ambrose Bierce's *The Devil's Dictionary*,
and a second evaluation text from another domain and century: *The Jargon File* 4.4.7.

The text is public domain (first published 1881-1906, copyright expired) and arrives offline with
Debian's ``dict-devil`` package (the dictd database ``devil.dict.dz`` + ``devil.index``):
scripts/setup.sh unpacks the package's files into ``.venv/share/dict-devil`` (a system-wide
install in /usr/share/dictd works too). Nobody on the team wrote it. It is period satire and has
a few entries with 19th-century slurs; we measure on it and never display it.

Its 999 entries are split by a fixed rule into two disjoint sets, in book order:
    evaluation   entries whose crc32(headword) % 5 == 0    (about 1/5, ~19k SmolLM2 tokens)
    calibration  all other entries                          (about 4/5, ~77k SmolLM2 tokens)
Hard-wrapped prose paragraphs are joined into single lines; indented verse and attributions keep
their lines.

    eval_windows(tokenizer, n, length[, split])     n non-overlapping windows, evenly spaced
    calibration_tokens(tokenizer, n, length, seed)  [n, length] int32, seeded random windows
    provenance()                                    package, version, file sha256, license, split

Every function takes ``corpus`` (default "devil"). "jargon" is the hackers' lexicon (1975-2003,
public domain by its authors' notice), from Debian's ``dict-jargon``, unpacked like dict-devil: the
whole of it is evaluation text (nothing is calibrated on it), a domain far from the calibration text.
"""

import functools
import gzip
import hashlib
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

DICTD = Path("usr/share/dictd")
# corpus -> its Debian package, dictd database name and what provenance() says of it
CORPORA = {
    "devil": {"package": "dict-devil", "db": "devil", "title": "The Devil's Dictionary",
              "author": "Ambrose Bierce (1842-c.1914)",
              "published": "1881-1906; book edition 1911 (Albert and Charles Boni)",
              "license": "public domain (copyright expired), as stated in the package's "
                         "usr/share/doc/dict-devil/copyright",
              "domain": "19th-century satirical dictionary"},
    "jargon": {"package": "dict-jargon", "db": "jargon", "title": "The Jargon File, version 4.4.7",
               "author": "Eric S. Raymond, Guy L. Steele Jr. and others",
               "published": "1975-2003; version 4.4.7 of 29 Dec 2003",
               "license": "public domain (\"This document (the Jargon File) is in the public domain\"), as "
                          "stated in the package's usr/share/doc/dict-jargon/copyright",
               "domain": "computing slang and hacker culture, 1970s-2000s"},
}
PACKAGE = CORPORA["devil"]["package"]
EVAL_MODULUS = 5
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
SPLITS = ("eval", "calibration")
WHOLE = "all"  # the whole book: for measurements nothing was fitted on (a KV cache on the source model)


def _b64(s):
    """dictd's base-64 numbers (offsets and lengths in the .index file)."""
    n = 0
    for c in s:
        n = n * 64 + B64.index(c)
    return n


def _reflow(entry, dedent=False):
    paragraphs = []
    for para in entry.strip("\n").split("\n\n"):
        if dedent:  # the Jargon File indents every body paragraph by 4
            para = textwrap.dedent(para)
        lines = [ln.rstrip() for ln in para.split("\n") if ln.strip()]
        if not lines:
            continue
        if any(ln.startswith(" ") for ln in lines):
            paragraphs.append("\n".join(lines))
        else:
            paragraphs.append(" ".join(" ".join(ln.split()) for ln in lines))
    return "\n\n".join(paragraphs)


def _corpus(corpus):
    if corpus not in CORPORA:
        raise ValueError(f"unknown text {corpus!r}; choose one of {', '.join(CORPORA)}")
    return CORPORA[corpus]


def roots(corpus="devil"):
    """Where a corpus's package files are looked for: unpacked into the venv by setup.sh, or installed."""
    return (Path(sys.prefix) / "share" / _corpus(corpus)["package"], Path("/"))


@functools.cache
def package_root(corpus="devil"):
    """The root holding usr/share/dictd/DB.{dict.dz,index}; FileNotFoundError if none does."""
    c = _corpus(corpus)
    for root in roots(corpus):
        if (root / DICTD / f"{c['db']}.dict.dz").is_file() and (root / DICTD / f"{c['db']}.index").is_file():
            return root
    raise FileNotFoundError(
        f"{c['db']}.dict.dz / {c['db']}.index not found under {' or '.join(str(r / DICTD) for r in roots(corpus))}: "
        f"the {corpus} text comes from the Debian package {c['package']} "
        f"(scripts/setup.sh unpacks it into .venv; or `apt-get install {c['package']}`)")


@functools.cache
def entries(corpus="devil"):
    """[(headword, text)] of the dictionary in book order, the database's own header entries dropped."""
    db = _corpus(corpus)["db"]
    files = package_root(corpus) / DICTD
    raw = gzip.decompress((files / f"{db}.dict.dz").read_bytes())
    seen, out = set(), []
    for line in (files / f"{db}.index").read_text(encoding="utf-8").splitlines():
        head, off, size = line.split("\t")
        offset, length = _b64(off), _b64(size)
        if head.startswith(("00database", "00-database")) or offset in seen:
            continue
        seen.add(offset)
        out.append((offset, head, _reflow(raw[offset: offset + length].decode("utf-8"), dedent=corpus != "devil")))
    return [(head, text) for _, head, text in sorted(out)]


def split_of(headword, corpus="devil"):
    if corpus != "devil":  # nothing is calibrated on the other texts
        return "eval"
    return "eval" if zlib.crc32(headword.encode()) % EVAL_MODULUS == 0 else "calibration"


@functools.cache
def text(split, corpus="devil"):
    """The ``split`` ('eval', 'calibration' or 'all') text: its entries in book order, blank-line separated."""
    if split not in SPLITS + (WHOLE,):
        raise ValueError(f"unknown text split {split!r}; choose one of {', '.join(SPLITS + (WHOLE,))}")
    if split == "calibration" and corpus != "devil":
        raise ValueError(f"the {corpus} text has no calibration split: it is evaluation text only")
    return "\n\n".join(t for h, t in entries(corpus) if split in (WHOLE, split_of(h, corpus)))


def tokens(tokenizer, split, corpus="devil"):
    """Token ids of a split, without special tokens (no bos: windows start mid-text anyway).

    ``tokenizer``: a transformers tokenizer or mlx-lm's wrapper of one. Its Rust backend encodes
    directly (the same ids; transformers would warn that the text exceeds model_max_length).
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text(split, corpus), add_special_tokens=False).ids
    return tokenizer.encode(text(split, corpus), add_special_tokens=False)


def eval_windows(tokenizer, n_windows, length, split="eval", corpus="devil"):
    """``n_windows`` non-overlapping windows of ``length`` tokens, evenly spaced over the ``split`` text
    (the eval text unless told otherwise)."""
    import mlx.core as mx

    ids = tokens(tokenizer, split, corpus)
    if n_windows < 1 or length < 2 or n_windows * length > len(ids):
        raise ValueError(f"the {corpus} {split} text has {len(ids)} tokens for this tokenizer, too few for "
                         f"{n_windows} windows of {length} (at most {len(ids) // max(length, 1)})")
    step = (len(ids) - length) // max(n_windows - 1, 1)
    return [mx.array(ids[i * step: i * step + length], dtype=mx.int32) for i in range(n_windows)]


def calibration_tokens(tokenizer, n_seqs, length, seed=0):
    """[n_seqs, length] int32 windows of the calibration text at seeded random offsets.

    Windows do not overlap while n_seqs * length fits in the text (the offsets are a random
    choice of distinct slots); beyond that they are drawn independently and may overlap.
    """
    import mlx.core as mx
    import numpy as np

    ids = np.asarray(tokens(tokenizer, "calibration"), dtype=np.int32)
    if n_seqs < 1 or length < 2 or length > len(ids):
        raise ValueError(f"the calibration text has {len(ids)} tokens; cannot cut {n_seqs} x {length}")
    rng = np.random.default_rng(seed)
    slots = len(ids) // length
    if n_seqs <= slots:
        starts = np.sort(rng.choice(slots, n_seqs, replace=False)) * length
    else:
        starts = rng.integers(0, len(ids) - length + 1, n_seqs)
    return mx.array(np.stack([ids[s: s + length] for s in starts]))


def _package_version(corpus="devil"):
    """The Debian version: from the .deb name setup.sh kept, else from dpkg."""
    root = package_root(corpus)
    if (root / "DEB").is_file():  # dict-devil_1.0-13.1_all.deb
        return (root / "DEB").read_text().strip().split("_")[1]
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", _corpus(corpus)["package"]],
                             capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


@functools.cache
def provenance(corpus="devil"):
    """What the artifact records about the text."""
    c = _corpus(corpus)
    splits = SPLITS if corpus == "devil" else ("eval",)
    counts = {s: sum(split_of(h, corpus) == s for h, _ in entries(corpus)) for s in splits}
    path = package_root(corpus) / DICTD / f"{c['db']}.dict.dz"
    return {
        "corpus": corpus,
        **{k: c[k] for k in ("title", "author", "published", "license", "domain")},
        "package": f"Debian {c['package']}",
        "package_version": _package_version(corpus),
        "file": str(path),
        "file_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "split_rule": (f"eval: crc32(headword) % {EVAL_MODULUS} == 0; calibration: the rest" if corpus == "devil"
                       else "eval: every entry (no calibration split)"),
        "entries": counts,
        "chars": {s: len(text(s, corpus)) for s in splits},
    }


# the shipped corpus the synthetic tokenizers were trained on (not real text)
CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


def corpus_windows(tokenizer, n_windows, length):
    """Windows of the shipped corpus the synthetic tokenizers were trained on (not real text)."""
    import mlx.core as mx

    ids = tokenizer.encode(CORPUS.read_text())
    if len(ids) < length + n_windows:
        raise ValueError(f"corpus has {len(ids)} tokens, too few for {n_windows} windows of {length}")
    step = (len(ids) - length) // n_windows
    return [mx.array(ids[i * step : i * step + length], dtype=mx.int32) for i in range(n_windows)]
