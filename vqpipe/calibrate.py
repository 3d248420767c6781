"""Calibrated quantization: GPTQ with input second moments collected block by block.

The model runs on calibration tokens one transformer block at a time. For block l we record
H = X^T X for the input X of every linear layer of the block (the block running in full precision
on the output of the already quantized blocks 0..l-1), quantize the block's linears with their H
(vqpipe/gptq.py), and run the quantized block to get block l+1's input. Later blocks therefore see
the earlier blocks' quantization error, as in GPTQ. Linears reading the same activation (q/k/v,
gate/up) share one H; layers outside the blocks get theirs from the same pass (an untied lm_head
reads the final norm), and embeddings are quantized data-free.

Needs an mlx-lm decoder: ``model.model`` with ``embed_tokens``, ``layers`` and ``norm``, blocks
called as ``layer(h, mask, cache=None)``. The mask is the plain causal one (calibration windows are
shorter than any sliding window we meet).
"""

import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .qlinear import QuantizedEmbedding, QuantizedLinear

BATCH_TOKENS = 4096  # tokens per forward batch: bounds the activations and attention scores


class _Recorder(nn.Module):
    """Stands in for a linear during a calibration pass: adds x^T x to its H, then runs it."""

    def __init__(self, inner, name, record):
        super().__init__()
        self.inner = inner
        self._name = name
        self._record = record

    def __call__(self, x):
        self._record(self._name, x)
        return self.inner(x)


def decoder(model):
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        raise ValueError(f"calibration needs an mlx-lm decoder (model.model with embed_tokens, layers, norm); "
                         f"{type(model).__name__} has none")
    return inner


def _set(model, name, module):
    model.update_modules(tree_unflatten([(name, module)]))


def _batches(x):
    per = max(1, BATCH_TOKENS // x.shape[1])
    return [x[i : i + per] for i in range(0, x.shape[0], per)]


def collect(model, names, run, inputs):
    """{name: (H key, H)} for the linears ``names``: ``run(batch)`` is called on each input batch
    with the linears replaced by recorders. Linears fed the same array share the H key."""
    modules = dict(model.named_modules())
    sums, owner = {}, {}
    seen = {}

    def record(name, x):
        key = seen.get(id(x))
        if key is None:
            key = seen[id(x)] = owner.get(name, name)
            flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
            prod = flat.T @ flat
            sums[key] = prod if key not in sums else sums[key] + prod
        owner.setdefault(name, key)

    for name in names:
        _set(model, name, _Recorder(modules[name], name, record))
    try:
        for batch in inputs:
            seen.clear()
            run(batch)
            mx.eval(list(sums.values()))
    finally:
        for name in names:
            _set(model, name, modules[name])
    return {name: (owner[name], sums[owner[name]]) for name in names if name in owner}


def quantize_calibrated(model, tokens, quantize_one, targets, progress=None):
    """Quantize ``targets`` [(name, kind)] of ``model`` in place with calibration ``tokens`` [n, len].

    ``quantize_one(name, kind, hessian)`` replaces one layer and returns its record (the caller's
    per-layer logic: rotation, seed, bits, group size). Returns the records in target order.
    """
    inner = decoder(model)
    kinds = dict(targets)
    records = {}
    for name, kind in targets:  # embeddings first: the calibration inputs come from the stored table
        if kind != "linear":
            records[name] = quantize_one(name, kind, None)
    prefix = {id(m): n for n, m in model.named_modules()}
    block_names = [prefix[id(layer)] for layer in inner.layers]
    h = [inner.embed_tokens(b) for b in _batches(tokens)]
    mx.eval(h)
    mask = "causal" if tokens.shape[1] > 1 else None
    for i, (layer, bname) in enumerate(zip(inner.layers, block_names)):
        t0 = time.perf_counter()
        names = [n for n in kinds if kinds[n] == "linear" and n.startswith(bname + ".")]
        stats = collect(model, names, lambda x: layer(x, mask, cache=None), h)
        for name in names:
            key, hess = stats[name]
            records[name] = quantize_one(name, "linear", hess)
            records[name]["hessian"] = key
        layer = inner.layers[i]
        h = [layer(x, mask, cache=None) for x in h]
        mx.eval(h)
        if progress:
            progress(f"[block {i + 1}/{len(inner.layers)}] {len(names)} layers {time.perf_counter() - t0:.2f}s")
    rest = [n for n in kinds if n not in records]
    normed = [inner.norm(x) for x in h] if rest else []
    for name in rest:  # an untied lm_head reads the final norm; anything else goes data-free
        records[name] = quantize_one(name, "linear", moments(normed) if name.split(".")[-1] == "lm_head" else None)
    return [records[n] for n, _ in targets if n in records]


def moments(xs):
    """sum of x^T x over a list of [..., d] arrays (float32)."""
    total = None
    for x in xs:
        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        total = flat.T @ flat if total is None else total + flat.T @ flat
    return total
