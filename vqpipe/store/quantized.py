"""The quantize artifact: the quantized model's state, its config and tokenizer files, and the
reference logits validate compares every reservoir against (written by vqpipe/stages/quantize.py)."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load_tokenizer

from ..bench.env import environment
from ..kernels.dequant import decoded_once
from ..layers.fused import fuse_model
from ..prefault import Prefault
from ..quant import residual_rotation
from ..quant.quantize import assemble, build_layers, quantized_layers, skeleton, split_state
from . import record
from .fsutil import atomic_dir, save_safetensors


REFERENCE_PROMPTS = (
    "The quick brown fox jumps over the lazy dog while the river runs north.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "In 1969 the first people walked on the Moon; the mission lasted eight days.",
    "Quantized weights keep their row norms; the rotation spreads outliers evenly.",
)


_CONFIG_DROP = ("quantization", "quantization_config")


PREFAULT_SLACK = 96 << 20  # the reference logits' other buffers taken from the same heap top


def copy_model_files(src, dst, extra_config=None):
    """Copy config and tokenizer files (not weights); drop affine quantization keys from config."""
    src, dst = Path(src), Path(dst)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
            "model.safetensors.index.json", "config.json", "vqpipe-source.json"
        ):
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    for key in _CONFIG_DROP:
        config.pop(key, None)
    if extra_config:
        config.update(extra_config)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def reference_tokens(tokenizer):
    return [mx.array(tokenizer.encode(p), dtype=mx.int32) for p in REFERENCE_PROMPTS]


class _Tap:
    """Stands in for a transformer block while the forwards are built: keeps its outputs."""

    def __init__(self, block, outs):
        self.block, self.outs = block, outs

    def __getattr__(self, name):  # a model may read its blocks' attributes (sliding windows, ...)
        return getattr(self.block, name)

    def __call__(self, *args, **kwargs):
        y = self.block(*args, **kwargs)
        self.outs.append(y)
        return y


def reference_logits(model, tokenizer):
    """{"tokens.i", "logits.i"}: float32 logits of each reference prompt, one forward each.

    The forwards are built first (MLX is lazy) with each layer's weight decoded once for all of
    them (dequant.decoded_once), then computed a transformer block at a time, every prompt's
    block l before any block l + 1, so a block's decoded weights are freed once its last prompt
    has used them: one block's (and the head's) are alive at a time, not the whole model's.
    Each prompt runs the same operations on the same values as a forward of its own: the same
    bytes. (qwen2.5-0.5b, on its own: the whole model's 2 GB of decoded float32 weights were held
    and faulted in; peak RSS 3.18 -> 1.19 GB, 13.8 -> 4.4 s; docs/results/2026-12-05-logs/quantize.md, "Fifth pass".)"""
    tokens = reference_tokens(tokenizer)
    inner = getattr(model, "model", None)
    blocks = getattr(inner, "layers", None)
    outs = []
    tapped = isinstance(blocks, list) and len(blocks) > 0
    if tapped:
        inner.layers = [_Tap(b, outs) for b in blocks]
    try:
        with decoded_once():
            logits = [model(t[None]).astype(mx.float32) for t in tokens]
    finally:
        if tapped:
            inner.layers = blocks
    # The largest decoded weight (a tied head's: qwen2.5-0.5b 545 MB of float32) is fresh memory,
    # whose page faults cost 1-3 s a GB on our VM: a helper thread populates it from the heap while
    # the blocks are computed (vqpipe/prefault.py; a no-op below 64 MB and on a GPU).
    biggest = max((m.out_features * m.in_features * 4 for m in quantized_layers(model).values()), default=0)
    with Prefault(biggest + PREFAULT_SLACK):
        if tapped and len(outs) == len(blocks) * len(tokens):
            for l in range(len(blocks)):  # outs: prompt 0's blocks in order, then prompt 1's, ...
                mx.eval(outs[l::len(blocks)])
        del outs[:]
        mx.eval(logits)
    out = {}
    for i, (t, y) in enumerate(zip(tokens, logits)):
        out[f"tokens.{i}"] = t
        out[f"logits.{i}"] = y[0]
    return out


def save_quantized(model, tokenizer, source_dir, out_dir, info):
    metas, arrays, params = split_state(model)
    tensors = {f"layers.{k}": v for k, v in arrays.items()}
    tensors.update({f"params.{k}": v for k, v in params.items()})
    with atomic_dir(out_dir, manifest=True) as tmp:
        save_safetensors(tmp / "quantized.safetensors", tensors)
        copy_model_files(source_dir, tmp, {"vqpipe": {k: info[k] for k in ("bits", "rotation", "seed")}})
        ref = reference_logits(model, tokenizer)  # each layer decoded once for the 4 prompts
        save_safetensors(tmp / "reference.safetensors", ref)
        env = environment()  # the reference logits' setup: validate compares against it
        (tmp / "reference.json").write_text(json.dumps(
            {"prompts": list(REFERENCE_PROMPTS), "environment": env}, indent=2) + "\n")
        record.write(tmp / "quantized.json", "quantize", {**info, "layers": metas},
                     model=record.model_name(source_dir), variant=f"b{info['bits']}-{info['rotation']}",
                     environment=env, inputs={"source": source_dir})


def load_quantized(path):
    """(model, tokenizer) from a quantize-stage artifact."""
    path = Path(path)
    meta = json.loads((path / "quantized.json").read_text())
    tensors = mx.load(str(path / "quantized.safetensors"))
    arrays = {k[len("layers."):]: v for k, v in tensors.items() if k.startswith("layers.")}
    params = {k[len("params."):]: v for k, v in tensors.items() if k.startswith("params.")}
    model = assemble(skeleton(path), build_layers(meta["layers"], arrays), params, str(path))
    residual_rotation.mark(model, meta.get("residual_rotation"))
    mx.eval(model.parameters())
    fuse_model(model)
    return model, load_tokenizer(path)
