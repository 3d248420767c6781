"""The calibrate stage: every linear's input second moments H = X^T X on the full-precision model.

Artifact (a directory, written atomically):
    moments.safetensors   one float32 H per distinct input ("<key>"): linears that read one
                          activation (q/k/v, gate/up) share a key; "final norm" feeds the head
    moments.json          {name: key} for every layer that has moments, the calibration spec and
                          its provenance, the time taken

Full precision (non-sequential) moments depend on neither the bit width nor the rotation, so
one artifact serves every quantize job of a model (``quantize --moments DIR``): the forward
passes over the calibration text run once per model instead of twice per block per job. What
is given up is GPTQ's sequential variant, where block l's moments come from the already
quantized blocks 0..l-1 (docs/quantize.md measures the difference).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

from .. import __version__, manifest, record
from ..calibrate import _batches, block_forward, collect, decoder, moments, tied_head
from ..fsutil import atomic_dir, save_safetensors

HEAD = "final norm"


def full_precision_moments(model, tokens, progress=None):
    """({name: key}, {key: H}) for every nn.Linear of ``model``'s blocks and its head (an
    lm_head, or the embedding table when it is tied), from one pass of the full-precision model."""
    import mlx.nn as nn

    inner = decoder(model)
    prefix = {id(m): n for n, m in model.named_modules()}
    linears = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    names, sums = {}, {}
    h = [inner.embed_tokens(b).astype(mx.float32) for b in _batches(tokens)]
    mx.eval(h)
    mask = "causal" if tokens.shape[1] > 1 else None
    for i, layer in enumerate(inner.layers):
        t0 = time.perf_counter()
        block = prefix[id(layer)] + "."
        stats, h = collect(model, [n for n in linears if n.startswith(block)], block_forward(layer, mask), h)
        for name, (key, hess) in stats.items():
            names[name], sums[key] = key, hess
        if progress:
            progress(f"[block {i + 1}/{len(inner.layers)}] {len(stats)} layers {time.perf_counter() - t0:.2f}s")
    heads = [n for n in linears if n.split(".")[-1] == "lm_head"]
    if tied_head(model):
        heads.append(prefix[id(inner.embed_tokens)])
    if heads:
        sums[HEAD] = moments([inner.norm(x) for x in h])
        mx.eval(sums[HEAD])
        names.update({n: HEAD for n in heads})
    return names, sums


def load(path):
    """({name: (key, H)}, info) from a calibrate artifact; layers sharing a key get the same array
    object (the quantizer factorises a shared H once)."""
    path = Path(path)
    manifest.verify(path)
    info = json.loads((path / "moments.json").read_text())
    arrays = mx.load(str(path / "moments.safetensors"))
    missing = sorted(set(info["layers"].values()) - set(arrays))
    if missing:
        raise ValueError(f"{path}: moments.json names moments that moments.safetensors lacks: {missing[:3]}")
    return {name: (key, arrays[key]) for name, key in info["layers"].items()}, info


def run(source, out, windows=16, length=512, seed=0, progress=print):
    from mlx_lm.utils import load as load_model

    from .quantize import calibration_tokens

    source = Path(source)
    if not (source / "config.json").is_file():
        raise ValueError(f"source model directory {source} has no config.json")
    manifest.verify(source)
    model, tokenizer = load_model(str(source), lazy=True)
    tokens, calib = calibration_tokens(tokenizer, "text", windows, length, seed)
    t0 = time.perf_counter()
    names, sums = full_precision_moments(model, tokens, progress)
    info = {"vqpipe_version": __version__, "source": str(source), "calibration": {**calib, "sequential": False},
            "layers": names, "seconds": time.perf_counter() - t0}
    with atomic_dir(out, manifest=True) as tmp:
        save_safetensors(tmp / "moments.safetensors", sums)
        record.write(tmp / "moments.json", "calibrate", info, inputs={"source": source})
    progress(f"moments of {len(names)} layers ({len(sums)} distinct) in {info['seconds']:.1f}s -> {out}")
    return info


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m vqpipe calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True, help="source model directory (download stage output)")
    p.add_argument("--out", required=True, help="output artifact directory")
    p.add_argument("--calib-windows", type=int, default=16, help="calibration windows")
    p.add_argument("--calib-length", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--calib-seed", type=int, default=0, help="seed of the calibration window offsets")
    args = p.parse_args(argv)
    try:
        run(args.source, args.out, args.calib_windows, args.calib_length, args.calib_seed)
    except (ValueError, OSError) as e:
        print(f"vqpipe calibrate: error: {e}", file=sys.stderr)
        return 2
    return 0
