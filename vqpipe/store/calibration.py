"""The calibrate artifact read back: each linear's input second moments and output sensitivities
(written by vqpipe/stages/calibrate.py; the layout is in its docstring)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..quant.recipe import LOOKUP
from . import manifest


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
    holds none (made with --no-sensitivity, or before the recipe). An artifact from before the
    lookup terms counted the moments' tokens gets them scaled here, as the stage now stores them."""
    path = Path(path)
    info = json.loads((path / "moments.json").read_text())
    found = [m for m in sets(info) if m["residual_rotation"] == residual]
    if not found or not info.get("sensitivity"):
        return None
    head = found[0]["prefix"] + FISHER
    arrays = mx.load(str(path / "moments.safetensors"))
    fisher = {k[len(head):]: np.asarray(v) for k, v in arrays.items() if k.startswith(head)}
    if "lookup_tokens" not in info["sensitivity"]:  # made before 2026-12-07: a lookup term was one token's
        tokens = info["calibration"]["windows"] * info["calibration"]["length"]
        fisher = {k: v * np.float32(tokens) if k.endswith(LOOKUP) else v for k, v in fisher.items()}
    return fisher
