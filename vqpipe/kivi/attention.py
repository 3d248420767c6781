"""Attention over a packed KIVI cache, and the hook that routes mlx-lm's attention to it.

- Decode (query length 1, no mask array) on a GPU: the fused kernel of
  :mod:`vqpipe.kivi.decode_kernel`, which reads the codes.
- Everything else (prefill chunks, mask arrays, the CPU): :func:`attend_tiles`, MLX ops over tiles
  of ``tile`` quantized tokens dequantized one at a time, the residual as one more tile, merged with
  an online softmax (running max and sum, rescaled when the max grows). No full-precision copy of
  the whole cache is ever made; in float32 throughout. A tile holds at most SCORES scores, so a
  prefill chunk's transient stays bounded whatever the context.

mlx-lm models call ``scaled_dot_product_attention(queries, keys, values, cache=..., scale=...,
mask=...)`` from ``mlx_lm.models.base``, imported by name into each model module.
:func:`install` wraps that name in the model's modules so a :class:`PackedKIVICache` goes to
:func:`attend`; every other cache goes to the original function unchanged.
"""

import sys

import mlx.core as mx

from . import decode_kernel, bitpack
from .store import PackedKIVICache

TILE = 4096  # at most this many quantized tokens dequantized at a time by the tile path
SCORES = 1 << 23  # and at most this many float32 scores per tile (32 MiB), so prefill stays small
# The running state is evaluated whenever this many scores were issued since the last evaluation.
# On MLX's CUDA backend an op's inputs stay allocated until the GPU has run the graph batch holding
# it, and the host queues batches far ahead: a 512-query chunk at 32k (Llama-3-8B geometry, 65
# tiles) held 2.2 GB of transients on the H200, every tile's scores at once
# (docs/results/2026-12-01-h200-kivi3). Evaluating waits for the queued work and frees them.
EVAL_SCORES = 1 << 24


def _tile_mask(mask, lq, offset, a, b):
    """The mask's columns for cache tokens [a, b): None, or a bool/additive array ending [L, b - a]."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        if offset - lq >= b - 1:  # every query sees the whole tile
            return None
        q_pos = mx.arange(offset - lq, offset)
        return q_pos[:, None] >= mx.arange(a, b)[None]
    return mask[..., a:b]


def _update(q, k, v, m, l, o, mask):
    """One tile of the online softmax: q [B, Hk, R*L, D] (scaled), k and v [B, Hk, T, D] float32,
    the running max m, sum l and accumulator o; mask None or [..., L, T] for the [B, Hq, L, T] scores."""
    b, hk, rl, _ = q.shape
    t = k.shape[2]
    s = q @ k.swapaxes(-1, -2)
    if mask is not None:
        lq = mask.shape[-2]
        s = s.reshape(b, -1, lq, t)
        if mask.dtype == mx.bool_:
            s = mx.where(mask, s, mx.finfo(mx.float32).min)
        else:
            s = s + mask.astype(mx.float32)
        s = s.reshape(b, hk, rl, t)
    mn = mx.maximum(m, mx.max(s, axis=-1, keepdims=True))
    p, alpha = mx.exp(s - mn), mx.exp(m - mn)
    return mn, l * alpha + mx.sum(p, axis=-1, keepdims=True), o * alpha + p @ v


def _update_codes(q, kc, kp, vc, vp, m, l, o, mask, bits, group_size):
    k = bitpack.dequantize_keys(kc, kp, bits, group_size)
    v = bitpack.dequantize_values(vc, vp, bits, group_size)
    return _update(q, k, v, m, l, o, mask)


# Not mx.compile'd: on MLX's CUDA backend every compiled trace JIT-compiles its fused kernels with
# NVRTC (seconds each) for every new tile shape, and a prefill meets many (the last tile's length
# changes with every chunk). H200 run 2 (docs/results/2026-12-01-h200-kivi) lost its whole
# benchmark window, likely to this; run 1, uncompiled, ran the same code paths in seconds.
_step = _update
_step_codes = _update_codes


def attend_tiles(queries, cache, scale, mask=None, tile=TILE):
    """softmax(q·K̂ᵀ·scale + mask)·V̂ over the cache, tile by tile, in float32; queries
    [B, Hq, L, D] (Hq a multiple of the cache's KV heads), the result in the queries' dtype. A tile
    holds at most ``tile`` tokens and SCORES scores."""
    b, hq, lq, d = queries.shape
    g = cache.group_size
    tile = max(g, min(tile, SCORES // (hq * lq * b)) // g * g)
    res = cache.residual()
    hk = res[0].shape[1]
    q = (queries.astype(mx.float32) * scale).reshape(b, hk, hq // hk * lq, d)
    m = mx.full((b, hk, q.shape[2], 1), -mx.inf, mx.float32)
    l = mx.zeros_like(m)
    o = mx.zeros((b, hk, q.shape[2], res[1].shape[3]), mx.float32)
    issued = 0
    for a in range(0, cache.quantized, tile):
        z = min(a + tile, cache.quantized)
        mt = _tile_mask(mask, lq, cache.offset, a, z)
        kc, kp = cache.kc[:, :, a // g : z // g], cache.kp[:, :, a // g : z // g]
        vc, vp = cache.vc[:, :, a:z], cache.vp[:, :, a:z]
        m, l, o = _step_codes(q, kc, kp, vc, vp, m, l, o, mt, cache.kv_bits, g)
        issued += b * hq * lq * (z - a)
        if issued >= EVAL_SCORES and z < cache.quantized:
            mx.eval(m, l, o)
            issued = 0
    if res[0].shape[2]:
        mt = _tile_mask(mask, lq, cache.offset, cache.quantized, cache.offset)
        valid = cache.residual_mask()  # a compiled step reads its whole residual buffer
        if valid is not None:
            if mt is not None:
                raise ValueError("a compiled KIVI step attends with one query and no mask")
            mt = valid
        m, l, o = _step(q, res[0].astype(mx.float32), res[1].astype(mx.float32), m, l, o, mt)
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


def packed_problem(model):
    """Why ``model``'s attention cannot read a packed KIVI cache (a sentence), or None: every decoder
    block's module must call mlx-lm's ``scaled_dot_product_attention``, which :func:`install`
    routes (Gemma 2's blocks compute soft-capped scores themselves). Installs the route."""
    install(model)
    other = set()
    for layer in getattr(model, "layers", None) or []:
        fn = getattr(sys.modules.get(type(layer).__module__), "scaled_dot_product_attention", None)
        if not hasattr(fn, "vqpipe_kivi_original"):
            other.add(type(layer).__module__)
    if not other:
        return None
    return (f"the packed KIVI cache needs attention through mlx-lm's scaled_dot_product_attention; "
            f"{', '.join(sorted(other))} computes attention itself (use the reference KIVI cache, "
            "--kv-cache reference, or no --kv-bits)")
