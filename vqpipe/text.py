"""Real English text for evaluation and calibration: Ambrose Bierce's *The Devil's Dictionary*.

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
"""

import functools
import gzip
import hashlib
import subprocess
import sys
import zlib
from pathlib import Path

PACKAGE = "dict-devil"
# Where the package's files are looked for: unpacked into the venv by setup.sh, or installed.
ROOTS = (Path(sys.prefix) / "share" / PACKAGE, Path("/"))
DICTD = Path("usr/share/dictd")
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


def _reflow(entry):
    paragraphs = []
    for para in entry.strip("\n").split("\n\n"):
        lines = [ln.rstrip() for ln in para.split("\n") if ln.strip()]
        if not lines:
            continue
        if any(ln.startswith(" ") for ln in lines):
            paragraphs.append("\n".join(lines))
        else:
            paragraphs.append(" ".join(" ".join(ln.split()) for ln in lines))
    return "\n\n".join(paragraphs)


@functools.cache
def package_root():
    """The root holding usr/share/dictd/devil.{dict.dz,index}; FileNotFoundError if none does."""
    for root in ROOTS:
        if (root / DICTD / "devil.dict.dz").is_file() and (root / DICTD / "devil.index").is_file():
            return root
    raise FileNotFoundError(
        f"devil.dict.dz / devil.index not found under {' or '.join(str(r / DICTD) for r in ROOTS)}: "
        f"the evaluation and calibration text comes from the Debian package {PACKAGE} "
        f"(scripts/setup.sh unpacks it into .venv; or `apt-get install {PACKAGE}`)")


@functools.cache
def entries():
    """[(headword, text)] of the dictionary in book order, the database's own header entries dropped."""
    files = package_root() / DICTD
    raw = gzip.decompress((files / "devil.dict.dz").read_bytes())
    seen, out = set(), []
    for line in (files / "devil.index").read_text(encoding="utf-8").splitlines():
        head, off, size = line.split("\t")
        offset, length = _b64(off), _b64(size)
        if head.startswith("00database") or offset in seen:
            continue
        seen.add(offset)
        out.append((offset, head, _reflow(raw[offset: offset + length].decode("utf-8"))))
    return [(head, text) for _, head, text in sorted(out)]


def split_of(headword):
    return "eval" if zlib.crc32(headword.encode()) % EVAL_MODULUS == 0 else "calibration"


@functools.cache
def text(split):
    """The ``split`` ('eval', 'calibration' or 'all') text: its entries in book order, blank-line separated."""
    if split not in SPLITS + (WHOLE,):
        raise ValueError(f"unknown text split {split!r}; choose one of {', '.join(SPLITS + (WHOLE,))}")
    return "\n\n".join(t for h, t in entries() if split in (WHOLE, split_of(h)))


def tokens(tokenizer, split):
    """Token ids of a split, without special tokens (no bos: windows start mid-text anyway).

    ``tokenizer``: a transformers tokenizer or mlx-lm's wrapper of one. Its Rust backend encodes
    directly (the same ids; transformers would warn that the text exceeds model_max_length).
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text(split), add_special_tokens=False).ids
    return tokenizer.encode(text(split), add_special_tokens=False)


def eval_windows(tokenizer, n_windows, length, split="eval"):
    """``n_windows`` non-overlapping windows of ``length`` tokens, evenly spaced over the ``split`` text
    (the eval text unless told otherwise)."""
    import mlx.core as mx

    ids = tokens(tokenizer, split)
    if n_windows < 1 or length < 2 or n_windows * length > len(ids):
        raise ValueError(f"the {split} text has {len(ids)} tokens for this tokenizer, too few for "
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


def _package_version():
    """The Debian version: from the .deb name setup.sh kept, else from dpkg."""
    root = package_root()
    if (root / "DEB").is_file():  # dict-devil_1.0-13.1_all.deb
        return (root / "DEB").read_text().strip().split("_")[1]
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", PACKAGE], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


@functools.cache
def provenance():
    """What the artifact records about the text."""
    counts = {s: sum(split_of(h) == s for h, _ in entries()) for s in SPLITS}
    return {
        "title": "The Devil's Dictionary",
        "author": "Ambrose Bierce (1842-c.1914)",
        "published": "1881-1906; book edition 1911 (Albert and Charles Boni)",
        "license": "public domain (copyright expired), as stated in the package's usr/share/doc/dict-devil/copyright",
        "package": f"Debian {PACKAGE}",
        "package_version": _package_version(),
        "file": str(package_root() / DICTD / "devil.dict.dz"),
        "file_sha256": hashlib.sha256((package_root() / DICTD / "devil.dict.dz").read_bytes()).hexdigest(),
        "split_rule": f"eval: crc32(headword) % {EVAL_MODULUS} == 0; calibration: the rest",
        "entries": counts,
        "chars": {s: len(text(s)) for s in SPLITS},
    }
