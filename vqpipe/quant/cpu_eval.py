"""Evaluation forward passes on the CPU with numpy doing the exponentials.

MLX's CPU backend evaluates exp, sigmoid and softmax at 15-20 ns an element (one core, this
machine; numpy's vectorised float32 exp: about 1 ns). In a 512-token SmolLM2 window that is most
of the forward pass: the attention softmax (30 layers x 9 heads x 512 x 512 entries), SiLU in the
MLP and the log-softmax over the 49,152-entry vocabulary took 2.2 of 4.0 CPU-s, the matmuls 1.2.
Inside :func:`numpy_exponentials` the attention (mx.fast.scaled_dot_product_attention, which on
the CPU is the plain matmul-softmax-matmul anyway) and mlx-lm's SwiGLU run in numpy; everything
else stays MLX. Causal attention goes a block of query rows at a time over only the keys the block
sees (half the scores at 512 tokens): a SmolLM2 window's forward + log-softmax went from 2.58 to
2.10 CPU-s (median of 6 each, interleaved, one process, load average ~20). Float32 throughout; the results differ from MLX's in rounding only
(tests/test_cpu_eval.py bounds it). Meant for bench-quality's dense float32 evaluation copies,
not for the quantized forward the artifacts' reference logits come from.
"""

import contextlib

import mlx.core as mx
import numpy as np


def _np(x):
    return np.asarray(x.astype(mx.float32) if x.dtype != mx.float32 else x)


def softmax_(s):
    """Softmax over the last axis, in place (float32 numpy)."""
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


# Query rows per block of the causal attention: a block's scores stop at its last row's key, so
# about half of the L x L square is never computed (at 512 tokens 12.6 -> 6.4 ms a SmolLM2 layer).
BLOCK = 32
_TRIANGLES = {}


def _triangle(m):
    """The [m, m] additive mask of a block's last m keys: -inf above the diagonal."""
    if m not in _TRIANGLES:
        _TRIANGLES[m] = np.triu(np.full((m, m), -np.inf, dtype=np.float32), k=1)
    return _TRIANGLES[m]


def causal_attention(q, k, v):
    """softmax(q k^T + causal mask) v for [B, Hk, rep, L, D] queries (scaled) and [B, Hk, S, D]
    keys and values, L <= S (query i sees keys 0 .. S - L + i), a block of query rows at a
    time over only the keys the block sees; normalised after the product with v."""
    n, s_len = q.shape[3], k.shape[2]
    kt = np.ascontiguousarray(k.swapaxes(-1, -2))[:, :, None]  # [B, Hk, 1, D, S]
    vv = v[:, :, None]
    out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=np.float32)
    for i0 in range(0, n, BLOCK):
        i1 = min(n, i0 + BLOCK)
        keys, m = s_len - n + i1, i1 - i0
        s = q[..., i0:i1, :] @ kt[..., :keys]
        s[..., keys - m:keys] += _triangle(m)
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        o = out[..., i0:i1, :]
        np.matmul(s, vv[..., :keys, :], out=o)
        o /= s.sum(axis=-1, keepdims=True)
    return out


def attention(queries, keys, values, scale, mask=None, sinks=None):
    """softmax(scale q k^T + mask) v with grouped KV heads: [B, Hq, L, D] x [B, Hk, S, D]."""
    if sinks is not None:
        raise ValueError("attention sinks are not supported by the numpy attention")
    dtype = queries.dtype
    q, k, v = _np(queries), _np(keys), _np(values)
    b, hq, n, d = q.shape
    hk, s_len = k.shape[1], k.shape[2]
    q = q.reshape(b, hk, hq // hk, n, d) * np.float32(scale)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        if n > s_len:
            raise ValueError(f"causal attention of {n} queries over {s_len} keys: needs queries <= keys")
        return mx.array(causal_attention(q, k, v).reshape(b, hq, n, -1)).astype(dtype)
    s = q @ k[:, :, None].swapaxes(-1, -2)  # [B, Hk, rep, L, S]
    if mask is not None:
        m = np.asarray(mask)
        m = m.reshape(m.shape[:-3] + (1,) * (5 - m.ndim) + m.shape[-3:]) if m.ndim >= 3 else m
        if m.dtype == np.bool_:
            s = np.where(m, s, np.float32(-np.inf))
        else:
            s += m.astype(np.float32)
    out = softmax_(s) @ v[:, :, None]
    return mx.array(out.reshape(b, hq, n, d)).astype(dtype)


def swiglu(gate, x, rows=32):
    """silu(gate) * x = gate * x / (1 + exp(-gate)), ``rows`` rows at a time into one output: the
    five passes then run in cache and no weight-sized temporary is faulted in (a SmolLM2 window,
    30 x [512, 1536]: 150 -> 45 ms), with the same values bit for bit."""
    g, u = _np(gate), _np(x)
    out = np.empty(g.shape, dtype=np.float32)
    gf, uf, of = g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1]), out.reshape(-1, g.shape[-1])
    for i in range(0, len(gf), rows):
        o = of[i : i + rows]
        np.negative(gf[i : i + rows], out=o)
        np.exp(o, out=o)
        o += 1
        np.divide(gf[i : i + rows], o, out=o)
        o *= uf[i : i + rows]
    return mx.array(out).astype(gate.dtype)


# mx.fast.rope as MLX's CPU backend runs it (fast.cpp's fallback): cos/sin of a [length, dims/2]
# angle table, then x1 cos - x2 sin and x1 sin + x2 cos, one elementwise op at a time. Each call
# rebuilds the table and walks the [B, H, L, D] input through seven MLX ops (a SmolLM2 window's
# 60 calls: 0.070 CPU-s; in numpy 0.038). The numpy version reads the table from MLX itself, once
# per setting: MLX's rope of a probe whose first half is 1 and second half 0 is exactly (cos, sin)
# (1 c - 0 s = c, 1 s + 0 c = s), so the values are MLX's bit for bit, whatever its formula
# (tests/test_cpu_eval.py). One table per (length, dims, base, scale, offset): a few per process.
_ROPE_TABLES = {}


def _rope_table(n, dims, traditional, base, scale, offset, freqs):
    key = (n, dims, traditional, base, scale, offset, None if freqs is None else np.asarray(freqs).tobytes())
    if key not in _ROPE_TABLES:
        probe = np.zeros((1, 1, n, dims), dtype=np.float32)
        probe[..., _rope_halves(dims, traditional)[0]] = 1
        cs = np.asarray(_MX_ROPE(mx.array(probe), dims, traditional=traditional, base=base, scale=scale,
                                 offset=offset, freqs=freqs))[0, 0]
        first, second = _rope_halves(dims, traditional)
        _ROPE_TABLES[key] = (np.ascontiguousarray(cs[:, first]), np.ascontiguousarray(cs[:, second]))
    return _ROPE_TABLES[key]


def _rope_halves(dims, traditional):
    """The slices of the rotated pairs' first and second members along the feature axis."""
    return (slice(0, dims, 2), slice(1, dims, 2)) if traditional else (slice(0, dims // 2), slice(dims // 2, dims))


def rope(x, dims, *, traditional, base=None, scale=1.0, offset=0, freqs=None, stream=None):
    """mx.fast.rope in numpy with MLX's own cos/sin table: the same values bit for bit. Anything
    but a float32 input with a plain integer offset (a KV cache's array offset, bf16) goes to MLX."""
    if x.dtype != mx.float32 or type(offset) is not int or dims % 2 or dims > x.shape[-1] or x.ndim < 2 \
            or stream is not None:
        return _MX_ROPE(x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs,
                        **({} if stream is None else {"stream": stream}))
    a = np.ascontiguousarray(_np(x))  # q and k arrive as transposed views: one copy, then long rows
    cos, sin = _rope_table(a.shape[-2], dims, traditional, base, scale, offset, freqs)
    first, second = _rope_halves(dims, traditional)
    x1, x2 = a[..., first], a[..., second]
    out = np.empty_like(a)
    out[..., dims:] = a[..., dims:]  # features past dims pass through
    o1, o2 = out[..., first], out[..., second]
    np.multiply(x1, cos, out=o1)
    o1 -= x2 * sin
    np.multiply(x1, sin, out=o2)
    o2 += x2 * cos
    return mx.array(out)


_MX_ROPE = mx.fast.rope


def log_softmax(logits, rows=16, out=None):
    """(log-probabilities, float32 numpy) of [..., V] MLX logits, ``rows`` rows at a time: each
    row's passes then run in cache (a [512, 49152] window: 84 -> 45 ms), with the same values.
    ``out``: a float32 array of the logits' shape to write them into (reused across windows)."""
    z = logits if isinstance(logits, np.ndarray) else _np(logits)  # may be ``out`` itself: in place
    flat = z.reshape(-1, z.shape[-1])
    if out is None or out.shape != z.shape or out.dtype != np.float32:
        out = np.empty(z.shape, dtype=np.float32)
    out = out.reshape(flat.shape)
    for i in range(0, len(flat), rows):
        o = out[i : i + rows]
        np.subtract(flat[i : i + rows], flat[i : i + rows].max(axis=-1, keepdims=True), out=o)
        o -= np.log(np.exp(o).sum(axis=-1, keepdims=True))
    return out.reshape(z.shape)


def head_weight(model):
    """The [vocab, hidden] float32 output head of an mlx-lm llama or qwen2 model (its tied
    embedding or its lm_head), as numpy; None for any other model or head (quantized, biased)."""
    import mlx.nn as nn

    args = getattr(model, "args", None)
    if getattr(model, "model_type", None) not in ("llama", "qwen2") or args is None:
        return None
    if getattr(args, "tie_word_embeddings", False):
        head = getattr(model.model, "embed_tokens", None)
        ok = type(head) is nn.Embedding
    else:
        head = getattr(model, "lm_head", None)
        ok = type(head) is nn.Linear and "bias" not in head
    return np.asarray(head.weight) if ok and head.weight.dtype == mx.float32 else None


def window_logprobs(model, tokens, out=None):
    """Log-probabilities [len, vocab] (float32 numpy) of one window of ``tokens`` (1-D), into
    ``out`` if it fits (reused across windows). The forward runs under :func:`numpy_exponentials`;
    for a llama/qwen2 model with a float32 head, numpy multiplies the final hidden states by the
    head straight into ``out`` and the log-softmax runs there in place: MLX's logits were a fresh
    100 MB array a SmolLM2 window, 0.15 CPU-s of page faults (the same products, same BLAS kernel
    family; tests/test_cpu_eval.py checks the values against the plain forward)."""
    w = head_weight(model)
    with numpy_exponentials():
        if w is None:
            return log_softmax(model(mx.array(tokens)[None])[0], out=out)
        h = _np(model.model(mx.array(tokens)[None])[0])
    shape = (h.shape[0], w.shape[0])
    if out is None or out.shape != shape or out.dtype != np.float32:
        out = np.empty(shape, dtype=np.float32)
    np.matmul(h, w.T, out=out)
    return log_softmax(out, out=out)


@contextlib.contextmanager
def numpy_exponentials():
    """Within: MLX's scaled dot-product attention, its RoPE and mlx-lm's swiglu (llama, qwen2 and
    every other model module that imported it) computed with numpy. Not thread-safe (it patches module
    attributes); restored on exit."""
    import sys

    patched = [(mx.fast, "scaled_dot_product_attention", attention), (mx.fast, "rope", rope)]
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "swiglu", None) is not None:
            patched.append((module, "swiglu", swiglu))
    saved = [(m, a, getattr(m, a)) for m, a, _ in patched]
    try:
        for m, a, f in patched:
            setattr(m, a, f)
        yield
    finally:
        for m, a, f in saved:
            setattr(m, a, f)
