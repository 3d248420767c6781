"""A checksum manifest (``manifest.json``) written into every stage artifact directory.

Artifacts travel: a between-workflow cache, a remote store, a copy on another machine. A bit that
flips on the way must be caught before a stage builds on it (a flipped scale in
quantized.safetensors would otherwise be packed into a reservoir with fresh, valid checksums), so
the writer records the size and SHA-256 of every file, and each consumer verifies the directories
it reads before it reads them. Hidden files (``.snakemake_timestamp``) are not covered.

A directory without a manifest is not an artifact of this vqpipe (a model directory given by a
user, an older artifact): ``verify`` then returns False and checks nothing.
"""

import hashlib
import json
import os
import threading
from pathlib import Path

NAME = "manifest.json"
FORMAT = "vqpipe-manifest"


class ManifestError(ValueError):
    """An artifact directory does not match its manifest; the message names the file."""


def sha256_file(path, chunk=1 << 22):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _files(directory):
    """Relative names of the files under ``directory`` a manifest covers (not hidden ones)."""
    out = []
    for root, dirs, files in os.walk(directory, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = Path(root).relative_to(directory)
        out += [str(rel / f) if str(rel) != "." else f for f in sorted(files)
                if not f.startswith(".") and not (str(rel) == "." and f == NAME)]
    return sorted(out)


def write(directory):
    """Write ``directory``/manifest.json covering every file in it (call it last)."""
    directory = Path(directory)
    files = {f: {"bytes": (directory / f).stat().st_size, "sha256": sha256_file(directory / f)} for f in _files(directory)}
    text = json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True) + "\n"
    (directory / NAME).write_text(text)
    return files


def verify(directory):
    """Check every file of ``directory`` against its manifest; True when checked, False when it
    has none. Raises ManifestError naming the first file that is missing, extra, or differs."""
    directory = Path(directory)
    path = directory / NAME
    if not path.is_file():
        return False
    try:
        doc = json.loads(path.read_bytes())
        files = doc["files"] if doc.get("format") == FORMAT else None
        if not isinstance(files, dict):
            raise ValueError("no file table")
    except (ValueError, UnicodeDecodeError, AttributeError, KeyError) as e:
        raise ManifestError(f"{path}: corrupted manifest ({e})") from None
    present = set(_files(directory))
    extra = sorted(present - set(files))
    if extra:
        raise ManifestError(f"{directory}: {extra[0]} is not in the artifact's manifest (a damaged or mixed-up copy)")
    for name, want in sorted(files.items()):
        f = directory / name
        if name not in present:
            raise ManifestError(f"{f}: listed in the manifest but missing (an incomplete copy)")
        if not isinstance(want, dict) or f.stat().st_size != want.get("bytes"):
            raise ManifestError(f"{f}: {f.stat().st_size} bytes, the manifest says {want.get('bytes') if isinstance(want, dict) else want!r}")
        got = sha256_file(f)
        if got != want.get("sha256"):
            raise ManifestError(f"{f}: SHA-256 {got[:16]}... differs from the manifest's: the file is corrupted")
    return True


class Background:
    """``verify(directory)`` on a helper thread; ``result()`` waits for it and returns its value or
    raises its error. hashlib and file reads release the GIL, so the checksums are computed
    beside the caller's work (the quantize stage's imports, load and first blocks): on a busy
    core budget a 988 MB source's SHA-256 is 0.7-2.5 s of the critical path otherwise."""

    def __init__(self, directory):
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(directory,), name="vqpipe-verify", daemon=True)
        self._thread.start()

    def _run(self, directory):
        try:
            self._value = verify(directory)
        except BaseException as e:  # handed to result(), on the caller's thread
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
