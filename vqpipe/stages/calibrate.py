"""The calibrate stage: every linear's input second moments H = X^T X on the full-precision model.

Artifact (a directory, written atomically):
    moments.safetensors   one float32 H per distinct input ("<key>"): linears that read one
                          activation (q/k/v, gate/up) share a key; "final norm" feeds the head
                          and "fisher/<name>": each layer's output sensitivity (vqpipe/quant/recipe.py,
                          the recipe's bit allocation: mean squared loss gradient per output, from
                          the first recipe.FISHER_WINDOWS windows; an embedding's lookup term times
                          the tokens H sums over, so that both count in one unit)
    moments.json          {name: key} for every layer that has moments, the calibration spec and
                          its provenance, the time taken

Full precision (non-sequential) moments depend on neither the bit width nor the rotation, so
one artifact serves every quantize job of a model (``quantize --moments DIR``): the forward
passes over the calibration text run once per model instead of twice per block per job. What
is given up is GPTQ's sequential variant, where block l's moments come from the already
quantized blocks 0..l-1 (docs/gptq.md measures the difference).
"""

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

from .. import __version__
from ..store import manifest, record
from ..quant import recipe, residual_rotation
from ..quant.calibrate import calibration_tokens, full_precision_moments
from ..store.calibration import FISHER, RESIDUAL_PREFIX
from ..store.fsutil import atomic_dir, save_safetensors


def run(source, out, windows=64, length=512, seed=0, progress=print, residual=None, rotation_seed=0, plain=None,
        sensitivity=True, text="text"):
    """Moments of the plain model and/or (``residual``: a rotation kind) of the model with the residual
    rotation quantize --residual-rotation --rotation KIND --seed ``rotation_seed`` folds in. ``plain``
    defaults to on without ``residual``, off with it. ``sensitivity``: also each layer's output
    sensitivity (vqpipe/quant/recipe.py), what the quantize stage's bit allocation reads."""
    from mlx_lm.utils import load as load_model

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
            fisher = recipe.output_fisher(model, tokens[: recipe.FISHER_WINDOWS], recipe.sensitive_layers(model), progress,
                                          tokens.size)
            tensors.update({prefix + FISHER + k: mx.array(v) for k, v in fisher.items()})
            progress(f"sensitivity of {len(fisher)} outputs in {time.perf_counter() - t1:.1f}s")
        found.append({"residual_rotation": residual_rotation.of(model), "prefix": prefix, "layers": names})
        tensors.update({prefix + k: v for k, v in sums.items()})
        del model
    info = {"vqpipe_version": __version__, "source": str(source), "calibration": {**calib, "sequential": False},
            "layers": found[0]["layers"], "sets": found, "seconds": time.perf_counter() - t0,
            # lookup_tokens: the lookup terms are scaled by it (recipe.output_fisher's moment_tokens)
            "sensitivity": {"windows": min(recipe.FISHER_WINDOWS, windows), "loss": "next-token NLL",
                            "lookup_tokens": windows * length} if sensitivity else None}
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
