"""The calibrate stage: every linear's input second moments H = X^T X on the full-precision model.

Artifact (a directory, written atomically):
    moments.safetensors   one float32 H per distinct input ("<key>"): linears that read one
                          activation (q/k/v, gate/up) share a key; "final norm" feeds the head
                          and "fisher/<name>": each layer's output sensitivity (vqpipe/quant/recipe.py,
                          the recipe's bit allocation: mean squared loss gradient per output, from
                          the first recipe.FISHER_WINDOWS windows)
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

from .. import __version__
from ..store import manifest, record
from ..quant import recipe, residual_rotation, selfgen  # noqa: F401 (self text: a code input)
from ..quant.calibrate import _batches, block_forward, collect, decoder, head_inputs, moments, tied_head
from ..store.fsutil import atomic_dir, save_safetensors

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
        sums[HEAD] = moments(head_inputs(model, [inner.norm(x) for x in h]))
        mx.eval(sums[HEAD])
        names.update({n: HEAD for n in heads})
    return names, sums


RESIDUAL_PREFIX = "residual/"  # the residual-rotated model's moments in the same file
FISHER = "fisher/"


def sets(info):
    """[{residual_rotation, prefix, layers}] of a moments.json (an artifact from before residual
    rotations holds one set, the plain model's)."""
    return info.get("sets") or [{"residual_rotation": None, "prefix": "", "layers": info["layers"]}]


def load(path, residual=None):
    """({name: (key, H)}, info) from a calibrate artifact: the set collected under residual rotation
    ``residual`` (an identity, vqpipe/quant/residual_rotation.py; None: the plain model). Layers sharing a
    key get the same array object (the quantizer factorises a shared H once)."""
    path = Path(path)
    manifest.verify(path)
    info = json.loads((path / "moments.json").read_text())
    found = [m for m in sets(info) if m["residual_rotation"] == residual]
    if not found:
        raise ValueError(f"{path}: no moments collected with residual rotation {residual} (it holds "
                         f"{[m['residual_rotation'] for m in sets(info)]}; calibrate --residual-rotation KIND --seed SEED)")
    layers, prefix = found[0]["layers"], found[0]["prefix"]
    arrays = mx.load(str(path / "moments.safetensors"))
    missing = sorted({prefix + k for k in layers.values()} - set(arrays))
    if missing:
        raise ValueError(f"{path}: moments.json names moments that moments.safetensors lacks: {missing[:3]}")
    return {name: (key, arrays[prefix + key]) for name, key in layers.items()}, info


def load_fisher(path, residual=None):
    """{name: sensitivity} (recipe.output_fisher's) from a calibrate artifact, or None where it
    holds none (made with --no-sensitivity, or before the recipe)."""
    path = Path(path)
    info = json.loads((path / "moments.json").read_text())
    found = [m for m in sets(info) if m["residual_rotation"] == residual]
    if not found or not info.get("sensitivity"):
        return None
    import numpy as np

    head = found[0]["prefix"] + FISHER
    arrays = mx.load(str(path / "moments.safetensors"))
    return {k[len(head):]: np.asarray(v) for k, v in arrays.items() if k.startswith(head)}


def run(source, out, windows=64, length=512, seed=0, progress=print, residual=None, rotation_seed=0, plain=None,
        sensitivity=True, text="text"):
    """Moments of the plain model and/or (``residual``: a rotation kind) of the model with the residual
    rotation quantize --residual-rotation --rotation KIND --seed ``rotation_seed`` folds in. ``plain``
    defaults to on without ``residual``, off with it. ``sensitivity``: also each layer's output
    sensitivity (vqpipe/quant/recipe.py), what the quantize stage's bit allocation reads."""
    from mlx_lm.utils import load as load_model

    from .quantize import calibration_tokens

    source = Path(source)
    if not (source / "config.json").is_file():
        raise ValueError(f"source model directory {source} has no config.json")
    plain = residual is None if plain is None else plain
    if not plain and residual is None:
        raise ValueError("calibrate: nothing to collect (no plain moments and no --residual-rotation)")
    manifest.verify(source)
    t0 = time.perf_counter()
    found, tensors, tokens = [], {}, None
    for rotated in [False] * plain + [True] * (residual is not None):
        model, tokenizer = load_model(str(source), lazy=True)
        if tokens is None:
            if text == "none":
                raise ValueError("calibrate: calibration text none collects nothing")
            tokens, calib = calibration_tokens(tokenizer, text, windows, length, seed, model)
        if rotated:  # the model quantize will see: moments in the rotated stream's basis
            from ..quant.quantize import rotate_for_quantize

            rotate_for_quantize(model, residual, rotation_seed)
        names, sums = full_precision_moments(model, tokens, progress)
        prefix = RESIDUAL_PREFIX if rotated else ""
        if sensitivity:
            t1 = time.perf_counter()
            fisher = recipe.output_fisher(model, tokens[: recipe.FISHER_WINDOWS], recipe.sensitive_layers(model), progress)
            tensors.update({prefix + FISHER + k: mx.array(v) for k, v in fisher.items()})
            progress(f"sensitivity of {len(fisher)} outputs in {time.perf_counter() - t1:.1f}s")
        found.append({"residual_rotation": residual_rotation.of(model), "prefix": prefix, "layers": names})
        tensors.update({prefix + k: v for k, v in sums.items()})
        del model
    info = {"vqpipe_version": __version__, "source": str(source), "calibration": {**calib, "sequential": False},
            "layers": found[0]["layers"], "sets": found, "seconds": time.perf_counter() - t0,
            "sensitivity": {"windows": min(recipe.FISHER_WINDOWS, windows), "loss": "next-token NLL"} if sensitivity else None}
    with atomic_dir(out, manifest=True) as tmp:
        save_safetensors(tmp / "moments.safetensors", tensors)
        record.write(tmp / "moments.json", "calibrate", info, inputs={"source": source})
    progress(f"moments of {len(found)} model(s), {len(tensors)} distinct, in {info['seconds']:.1f}s -> {out}")
    return info


def main(argv=None):
    p = argparse.ArgumentParser(prog="vqpipe calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True, help="source model directory (download stage output)")
    p.add_argument("--out", required=True, help="output artifact directory")
    p.add_argument("--calibration", default="text", choices=("text", "self"),
                   help="text (default): the calibration split of vqpipe/text.py; self: text the model writes itself "
                   "(vqpipe/quant/selfgen.py)")
    p.add_argument("--calib-windows", type=int, default=64, help="calibration windows")
    p.add_argument("--calib-length", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--calib-seed", type=int, default=0, help="seed of the calibration window offsets")
    p.add_argument("--residual-rotation", default=None, choices=("auto", "hadamard", "kron"), metavar="KIND",
                   help="collect the moments of the model with a residual rotation of this kind folded in, as "
                        "quantize --residual-rotation --rotation KIND --seed SEED makes it (vqpipe/quant/residual_rotation.py)")
    p.add_argument("--seed", type=int, default=0, help="with --residual-rotation: quantize's rotation seed")
    p.add_argument("--plain", action=argparse.BooleanOptionalAction, default=None,
                   help="also (or only) the plain model's moments (default: only without --residual-rotation); "
                        "quantize jobs without the residual rotation read those")
    p.add_argument("--sensitivity", action=argparse.BooleanOptionalAction, default=True,
                   help="also each layer's output sensitivity, for quantize's bit allocation (vqpipe/quant/recipe.py; default)")
    args = p.parse_args(argv)
    try:
        run(args.source, args.out, args.calib_windows, args.calib_length, args.calib_seed,
            residual=args.residual_rotation, rotation_seed=args.seed, plain=args.plain, sensitivity=args.sensitivity,
            text=args.calibration)
    except (ValueError, OSError) as e:
        print(f"vqpipe calibrate: error: {e}", file=sys.stderr)
        return 2
    return 0
