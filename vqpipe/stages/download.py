"""Download stage: fetch a model source into a Hugging Face layout directory.

Sources:
  ``synth:PRESET[-4bit]``  deterministic offline synthetic model (``vqpipe.sources.synth``)
  ``hf:REPO[@REVISION]``   Hugging Face Hub snapshot (or the local HF cache when offline)
  ``path:DIR``             a local model directory, copied
  ``gguf:FILE``            a llama.cpp GGUF file, converted (``gguf:pkg:PACKAGE/PATH``: a file
                           shipped in an installed Python package; see ``vqpipe.sources.gguf``)

The output directory appears atomically (built next to it, then renamed) and holds
``vqpipe-source.json``: the source string, parameter count and sha256 of every file.
"""

import argparse
import json
import os
import shutil
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from ..store import fsutil, manifest, record
from ..sources.spec import check_model_dir, parse_source
from ..store.manifest import sha256_file

SOURCE_FILE = "vqpipe-source.json"

# What mlx_lm fetches from a repo (weights, configs, tokenizers, chat templates), less code: a
# source never runs anything of the model's (no *.py, no trust_remote_code, no pickled weights).
HF_ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
HUB_CONNECT_TIMEOUT_S = 3.0
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def log(msg):
    print(f"[download] {msg}", flush=True)


def fetch(source, out_dir, seed=0, dtype="bfloat16"):
    """Write the model named by ``source`` into ``out_dir`` (replacing it) and return its path.

    ``dtype`` is the weight dtype of a converted ``gguf:`` source (the others keep their own).

    The model is built in a temporary directory next to ``out_dir`` and renamed into place, so
    an interrupted fetch never leaves a partial ``out_dir``.
    """
    scheme, value = parse_source(source)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if scheme == "synth":
        from ..sources import synth

        synth.parse_preset(value)  # fail on a bad preset before touching the disk
    if scheme == "gguf":
        from ..sources import gguf

        gguf.open_reader(gguf.resolve(value))  # fail on a missing or bad file before touching the disk

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fsutil.clean_stale_temps(out_dir)  # leftovers of killed fetches of out_dir
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=fsutil.temp_prefix(out_dir), suffix=".tmp"))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the model dir should be readable
        if scheme == "synth":
            log(f"building synthetic model {value!r} (seed {seed})")
            info = {"preset": value, "seed": seed, "synth": synth.build(value, tmp, seed)}
        elif scheme == "hf":
            info = fetch_hf(value, tmp)
        elif scheme == "gguf":
            info = gguf.fetch_gguf(value, tmp, dtype)
        else:
            info = fetch_path(value, tmp)
        write_source_json(tmp, {"source": source, "scheme": scheme, **info}, out_dir)
        manifest.write(tmp)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {out_dir} in {time.perf_counter() - start:.1f} s")
    return out_dir


def replace_dir(src, dst):
    """Put ``src`` at ``dst`` (an exchange where the file system can: never a partial ``dst``)."""
    for f in Path(src).rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    old = fsutil.replace_dir(src, dst)
    fsutil.fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# path: and hf:


# Never copied from a source: code, and weight formats that unpickle (run code) when loaded.
UNSAFE_SUFFIXES = (".py", ".pyc", ".pyo", ".so", ".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")


def copy_model_dir(src, dst, root=None):
    """Copy the files of ``src`` into ``dst``, except hidden ones, code and pickles.

    Links are followed only to files inside ``root`` (default ``src``; a HF snapshot's links
    point into its repository's blob store): a source cannot make the copy read files elsewhere.
    Only names listed from ``src`` are written, each inside ``dst``.
    """
    src, dst = Path(src), Path(dst)
    root = Path(root or src).resolve()
    for entry in sorted(src.iterdir()):
        name = entry.name
        if name.startswith(".") or name in (SOURCE_FILE, manifest.NAME) or name.lower().endswith(UNSAFE_SUFFIXES):
            continue
        target = entry.resolve()
        if not target.is_relative_to(root):
            raise ValueError(f"{entry} links to {target}, outside the source {root}: not copied")
        out = dst / name
        if not out.resolve().is_relative_to(dst.resolve()):  # a name like '..' (never from iterdir)
            raise ValueError(f"{entry}: the name {name!r} would be written outside {dst}")
        if target.is_dir():
            out.mkdir()
            copy_model_dir(entry, out, root)
        elif target.is_file():
            shutil.copyfile(target, out)


def fetch_path(value, dst):
    src = Path(value).expanduser()
    check_model_dir(src)
    log(f"copying {src}")
    copy_model_dir(src, dst)
    return {"path": str(src.resolve())}


def hub_unreachable(endpoint, timeout=HUB_CONNECT_TIMEOUT_S):
    """Why a TCP connection to ``endpoint`` fails within ``timeout`` s, or None if it opens.

    Skipped behind a proxy, where a direct connection says nothing.
    """
    if any(os.environ.get(v) for v in PROXY_VARS):
        return None
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        return f"cannot connect to {url.hostname}:{port}: {e}"
    return None


def fetch_hf(value, dst):
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import validate_repo_id

    repo, _, revision = value.partition("@")
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise ValueError(f"bad Hugging Face repo id {repo!r} in 'hf:{value}': {e}") from None

    endpoint = os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")
    # Read the environment now too: constants only sees it at import time.
    offline_env = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    offline = constants.HF_HUB_OFFLINE or offline_env
    reason = "HF_HUB_OFFLINE is set" if offline else hub_unreachable(endpoint)
    if reason:
        log(f"not contacting the hub ({reason}); looking in the local Hugging Face cache")
    else:
        log(f"downloading {repo}" + (f" @ {revision}" if revision else "") + f" from {endpoint}")
    try:
        snapshot = snapshot_download(
            repo,
            revision=revision or None,
            allow_patterns=HF_ALLOW_PATTERNS,
            local_files_only=bool(reason),
            endpoint=endpoint,
        )
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ValueError(f"hf:{value} not found on {endpoint}: {e}") from None
    except (LocalEntryNotFoundError, ConnectionError) as e:
        why = reason or str(e).splitlines()[0]
        raise ConnectionError(
            f"the Hugging Face Hub at {endpoint} is unreachable ({why}) and {repo!r} is not in "
            f"the local cache. Without network, use synth:PRESET for a synthetic model or "
            f"path:DIR for a model directory on disk."
        ) from None
    check_model_dir(snapshot)
    copy_model_dir(snapshot, dst, root=Path(snapshot).resolve().parents[1])  # models--ORG--NAME
    return {"repo": repo, "revision": revision or None, "snapshot": Path(snapshot).name}


# ---------------------------------------------------------------------------------------------
# vqpipe-source.json


def safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def count_parameters(model_dir):
    """Parameters of the checkpoint, counting packed quantized weights at their logical size."""
    model_dir = Path(model_dir)
    quant = json.loads((model_dir / "config.json").read_text()).get("quantization") or {}
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        header = safetensors_header(path)
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for d in meta["shape"]:
                n *= d
            module, _, leaf = name.rpartition(".")
            quantized = f"{module}.scales" in header
            if quantized and leaf in ("scales", "biases"):
                continue
            if quantized and leaf == "weight":
                bits = (quant.get(module) or quant)["bits"]
                n = n * 32 // bits
            total += n
    return total


def write_source_json(model_dir, info, out_dir=None):
    files = {
        str(p.relative_to(model_dir)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(model_dir.rglob("*"))
        if p.is_file()
    }
    info = {**info, "parameters": count_parameters(model_dir), "files": files}
    record.write(model_dir / SOURCE_FILE, "download", info, model=record.model_name(out_dir or model_dir))


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv=None):
    from ..sources.synth import PRESETS

    parser = argparse.ArgumentParser(
        prog="vqpipe download",
        description="Fetch a model into a Hugging Face layout directory.",
    )
    parser.add_argument(
        "--source",
        required=True,
        help="synth:PRESET[-4bit] (presets: " + ", ".join(PRESETS) + "), hf:REPO[@REVISION], path:DIR, "
        "gguf:FILE or gguf:pkg:PACKAGE/PATH",
    )
    parser.add_argument("--out", required=True, type=Path, help="output model directory (replaced)")
    parser.add_argument("--seed", type=int, default=0, help="seed for synth: sources (default 0)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="weight dtype of a converted gguf: source (default bfloat16)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        fetch(args.source, args.out, args.seed, args.dtype)
    except (ValueError, OSError) as e:  # OSError: a missing path, disk full, no network, named
        where = "" if isinstance(e, ValueError) or e.filename else f"writing {args.out}: "
        print(f"vqpipe download: error: {where}{e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
