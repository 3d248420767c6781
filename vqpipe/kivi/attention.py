"""Attention over a packed KIVI cache, and the hook that routes mlx-lm's attention to it.

- Decode (query length 1, no mask array) on a GPU: the fused kernel of
  :mod:`vqpipe.kivi.decode_kernel`, which reads the codes.
- Everything else (prefill chunks, mask arrays, the CPU): :func:`attend_tiles`, MLX ops over tiles
  of ``tile`` quantized tokens dequantized one at a time, the residual as one more tile, merged with
  an online softmax (running max and sum, rescaled when the max grows). No full-precision copy of
  the whole cache is ever made; in float32 throughout.

mlx-lm models call ``scaled_dot_product_attention(queries, keys, values, cache=..., scale=...,
mask=...)`` from ``mlx_lm.models.base``, imported by name into each model module.
:func:`install` wraps that name in the model's modules so a :class:`PackedKIVICache` goes to
:func:`attend`; every other cache goes to the original function unchanged.
"""

import sys

import mlx.core as mx

from . import decode_kernel
from .store import PackedKIVICache

TILE = 4096  # quantized tokens dequantized at a time by the tile path


def _tile_mask(mask, lq, offset, a, b):
    """The mask's columns for cache tokens [a, b): None, or a bool/additive array ending [L, b - a]."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        if lq == 1:
            return None
        q_pos = mx.arange(offset - lq, offset)
        return q_pos[:, None] >= mx.arange(a, b)[None]
    return mask[..., a:b]


def _blocks(cache, tile):
    """(first token, keys, values) of each tile: the quantized tokens, then the residual."""
    g = cache.group_size
    tile = max(g, tile // g * g)
    for a in range(0, cache.quantized, tile):
        k, v = cache.dequantized(a, min(a + tile, cache.quantized))
        yield a, k, v
    res = cache.residual()
    if res is not None and res[0].shape[2]:
        yield cache.quantized, res[0].astype(mx.float32), res[1].astype(mx.float32)


def attend_tiles(queries, cache, scale, mask=None, tile=TILE):
    """softmax(q·K̂ᵀ·scale + mask)·V̂ over the cache, tile by tile, in float32; queries
    [B, Hq, L, D] (Hq a multiple of the cache's KV heads), the result in the queries' dtype."""
    b, hq, lq, d = queries.shape
    q = queries.astype(mx.float32) * scale
    m = l = o = None
    for a, k, v in _blocks(cache, tile):
        hk, t = k.shape[1], k.shape[2]
        r = hq // hk
        s = q.reshape(b, hk, r * lq, d) @ k.swapaxes(-1, -2)
        mt = _tile_mask(mask, lq, cache.offset, a, a + t)
        if mt is not None:
            s = s.reshape(b, hq, lq, t)
            if mt.dtype == mx.bool_:
                s = mx.where(mt, s, mx.finfo(mx.float32).min)
            else:
                s = s + mt.astype(mx.float32)
            s = s.reshape(b, hk, r * lq, t)
        mb = mx.max(s, axis=-1, keepdims=True)
        if m is None:
            p = mx.exp(s - mb)
            m, l, o = mb, mx.sum(p, axis=-1, keepdims=True), p @ v
        else:
            mn = mx.maximum(m, mb)
            p, alpha = mx.exp(s - mn), mx.exp(m - mn)
            m, l, o = mn, l * alpha + mx.sum(p, axis=-1, keepdims=True), o * alpha + p @ v
    return (o / l).reshape(b, hq, lq, -1).astype(queries.dtype)


def attend(queries, cache, scale, mask=None, use_kernels=None):
    """Attention of ``queries`` over a :class:`PackedKIVICache`: the fused decode kernel where it
    applies (query length 1, no mask array, a GPU, a supported geometry), else the tile path."""
    use = cache.use_kernels if use_kernels is None else use_kernels
    lq = queries.shape[2]
    if lq == 1 and (mask is None or isinstance(mask, str)) and decode_kernel.applies(queries, cache, use):
        return decode_kernel.decode_attention(queries, cache, scale)
    return attend_tiles(queries, cache, scale, mask)


def _routed(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, PackedKIVICache):
            if sinks is not None:
                raise ValueError("the packed KIVI cache does not support attention sinks")
            return attend(queries, cache, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.vqpipe_kivi_original = original
    return scaled_dot_product_attention


def install(model):
    """Route the attention of ``model``'s modules to :func:`attend` for packed KIVI caches.
    Idempotent; other caches keep mlx-lm's own attention. Returns the names of the modules
    patched (empty when they already were, or when none imports the function)."""
    names = {type(model).__module__} | {type(m).__module__ for m in model.modules()}
    patched = []
    for name in sorted(names):
        mod = sys.modules.get(name)
        fn = getattr(mod, "scaled_dot_product_attention", None)
        if fn is None or hasattr(fn, "vqpipe_kivi_original"):
            continue
        setattr(mod, "scaled_dot_product_attention", _routed(fn))
        patched.append(name)
    return patched
