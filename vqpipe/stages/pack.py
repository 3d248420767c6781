"""The pack stage: a quantize artifact -> a reservoir directory.

Output (written atomically): model.vqres (docs/reservoir-format.md), config.json and tokenizer
files, pack.json (sizes, ideal payload, persist_rotation). The tensors are copied from
quantized.safetensors as they are: no model is built and nothing is quantized again.
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx

from ..store import manifest, record
from ..store.fsutil import atomic_dir
from ..store.reservoir import FILE_NAME, sizes, write_reservoir

_NOT_COPIED = ("quantized.json", "reference.json")
_PERSIST = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


def parse_persist(value):
    try:
        return _PERSIST[str(value).strip().lower()]
    except KeyError:
        raise ValueError(f"--persist-rotation must be on or off, got {value!r}") from None


def read_artifact(quantized):
    """(layer metas, layer arrays, params, config, residual rotation or None) of a quantize-stage artifact."""
    quantized = Path(quantized)
    for name in ("quantized.json", "quantized.safetensors", "config.json"):
        if not (quantized / name).is_file():
            raise ValueError(f"{quantized} is not a quantize artifact: {name} is missing")
    manifest.verify(quantized)  # before a single tensor is read: a flipped bit must not be packed
    meta = json.loads((quantized / "quantized.json").read_text())
    tensors = mx.load(str(quantized / "quantized.safetensors"))
    arrays = {k[len("layers."):]: v for k, v in tensors.items() if k.startswith("layers.")}
    params = {k[len("params."):]: v for k, v in tensors.items() if k.startswith("params.")}
    config = json.loads((quantized / "config.json").read_text())
    return meta["layers"], arrays, params, config, meta.get("residual_rotation")


def _reference_setup(quantized):
    path = Path(quantized) / "reference.json"
    if not path.is_file():
        return None
    env = json.loads(path.read_text()).get("environment") or {}
    return {k: env.get(k) for k in ("backend", "device", "blas", "versions")}


def run(quantized, out, persist_rotation, progress=print):
    t0 = time.perf_counter()
    quantized, out = Path(quantized), Path(out)
    metas, arrays, params, config, residual = read_artifact(quantized)
    with atomic_dir(out, manifest=True) as tmp:
        header = write_reservoir(tmp / FILE_NAME, metas, arrays, params, persist_rotation, config, residual)
        for f in quantized.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in _NOT_COPIED + (manifest.NAME,):
                shutil.copy2(f, tmp / f.name)
        info = {
            "quantized": str(quantized),
            "persist_rotation": bool(persist_rotation),
            "n_layers": len(metas),
            # The setup the reference logits were made under: vqpipe.load warns when it differs.
            "reference_setup": _reference_setup(quantized),
            "seconds": time.perf_counter() - t0,
            **sizes(header),
        }
        q = json.loads((quantized / "quantized.json").read_text())
        info = record.write(tmp / "pack.json", "pack", info, model=q.get("model"), variant=q.get("variant"),
                            inputs={"quantized": quantized})
    progress(f"packed {len(metas)} layers, persist_rotation={'on' if persist_rotation else 'off'}: "
             f"{info['file_bytes'] / 2**20:.1f} MiB, {info['file_over_ideal']:.3f}x the ideal payload -> {out}")
    return info


def main(argv=None):
    p = argparse.ArgumentParser(prog="vqpipe pack", description=__doc__.split("\n")[0])
    p.add_argument("--quantized", required=True, help="quantize-stage artifact directory")
    p.add_argument("--out", required=True, help="output reservoir directory")
    p.add_argument("--persist-rotation", required=True, metavar="on|off",
                   help="on: store dense QR rotations; off: store their seeds and regenerate at load")
    args = p.parse_args(argv)
    try:
        run(args.quantized, args.out, parse_persist(args.persist_rotation))
    except (ValueError, OSError) as e:  # OSError: e.g. disk full, named with its path
        where = "" if isinstance(e, ValueError) or e.filename else f"writing {args.out}: "
        print(f"vqpipe pack: error: {where}{e}", file=sys.stderr)
        return 2
    return 0
