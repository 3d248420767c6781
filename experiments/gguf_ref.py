"""An independent evaluation of a GGUF file: a float32 NumPy forward pass in llama.cpp's conventions.

It shares no code with the converter (vqpipe/sources/gguf.py): weights are dequantized by the ``gguf``
package (not MLX), Q/K stay in llama.cpp's permuted row order and RoPE rotates adjacent pairs
(llama.cpp's "normal" mode) for llama, halves ("neox" mode) for qwen2, qwen3 (which also
normalises each head of q and k by its own RMSNorm before RoPE) and gemma3. If the converted model's
logits match these, the permutation was undone correctly. gemma3 follows llama.cpp's graph of it:
the embedding times sqrt(hidden), the stored norm weights used as they are (1 + w), norms after
attention and around the MLP, GELU (tanh), every 6th layer global and the others attending to the
last ``sliding_window`` positions with RoPE base 10,000, the linear RoPE scaling on global layers
only, the attention scale 1/sqrt(head_dim) (1/sqrt(hidden / heads) for 62 layers). gemma2 is the same
block without q/k norms, every other layer sliding (window 4096 unless stored), one RoPE base, the
attention scores soft-capped before the mask (cap 50 unless stored) and the logits after the head
(30), the scale 1/sqrt(hidden / heads) at 46 layers. phi3 reads q, k, v from one matrix and gate,
up from another (SwiGLU of the halves), with NeoX RoPE and no window (llama.cpp disables Phi's);
LongRoPE divides the frequencies by the file's long or short factors by the context llama.cpp runs
with, and multiplies cos and sin by its attn_factor; only the first rope.dimension_count dims of a
head rotate (Phi-4 mini: 96 of 128).

    python -m experiments.gguf_ref FILE CONVERTED_DIR   # compares the two on a chat prompt
"""

import sys

import numpy as np

NEOX_ARCHS = ("qwen2", "qwen3", "gemma3", "phi3")


def read(path):
    """(metadata dict, {tensor name: float32 array in [out, in] order}) via the gguf package."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    weights = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        weights[t.name] = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
    return meta, weights


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, base, neox, scale=1.0, factors=None, mscale=1.0, dims=None):
    """x: [T, heads, D]; llama.cpp's rotary embedding at positions 0..T-1 (times ``scale``);
    ``factors`` divide the frequencies and ``mscale`` multiplies cos and sin (ggml_rope_ext's
    freq_factors and attn_factor: LongRoPE); ``dims``: only the first that many dims rotate
    (rope.dimension_count), the rest pass through."""
    if dims is not None and dims < x.shape[-1]:
        return np.concatenate([rope(x[..., :dims], base, neox, scale, factors, mscale), x[..., dims:]], axis=-1)
    t, _, d = x.shape
    freqs = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if factors is not None:
        freqs = freqs / np.asarray(factors, dtype=np.float64)
    ang = np.arange(t)[:, None] * scale * freqs[None]
    cos, sin = (mscale * np.cos(ang))[:, None].astype(np.float32), (mscale * np.sin(ang))[:, None].astype(np.float32)
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def attention(q, k, v, scale=None, window=None, cap=None):
    """Causal GQA attention; q [T, H, D], k/v [T, KV, D]; ``window``: a query sees the keys less than
    that many positions back (llama.cpp's standard sliding window); ``cap``: scores soft-capped,
    cap * tanh(s / cap), before the mask."""
    t, h, d = q.shape
    rep = h // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("thd,shd->hts", q, k) * (1 / np.sqrt(d) if scale is None else scale)
    if cap:
        s = np.tanh(s / cap) * cap
    pos = np.arange(t)
    seen = pos[:, None] >= pos[None]
    if window:
        seen &= pos[:, None] - pos[None] < window
    s = np.where(seen[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v).reshape(t, h * d)


def linear(w, name, x):
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y


def logits(path, tokens, context=None):
    """float32 logits [T, vocab] of the GGUF model on ``tokens``, run as llama.cpp would with a
    context of ``context`` tokens (default the file's context_length): phi3's LongRoPE takes its long
    factors above the original context, its short ones at or below."""
    meta, w = read(path)
    arch = meta["general.architecture"]
    m = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    if arch == "gemma3":
        return gemma3_logits(w, m, tokens)
    if arch == "gemma2":
        return gemma2_logits(w, m, tokens)
    heads, kv = int(m("attention.head_count")), int(m("attention.head_count_kv", m("attention.head_count")))
    eps, base = float(m("attention.layer_norm_rms_epsilon")), float(m("rope.freq_base", 10000.0))
    factors, mscale = None, 1.0
    if "rope_factors_long.weight" in w:
        longer = (context or int(m("context_length"))) > int(m("rope.scaling.original_context_length"))
        factors = w["rope_factors_long.weight" if longer else "rope_factors_short.weight"]
        mscale = float(m("rope.scaling.attn_factor", 1.0))
    rot = m("rope.dimension_count")
    x = w["token_embd.weight"][np.asarray(tokens)]
    for i in range(int(m("block_count"))):
        b = f"blk.{i}."
        h = rms_norm(x, w[b + "attn_norm.weight"], eps)
        if b + "attn_qkv.weight" in w:  # phi3: rows q, then k, then v
            qkv = linear(w, b + "attn_qkv", h)
            d = qkv.shape[-1] // (heads + 2 * kv)
            q, k, v = np.split(qkv, [heads * d, (heads + kv) * d], axis=-1)
        else:
            q, k, v = linear(w, b + "attn_q", h), linear(w, b + "attn_k", h), linear(w, b + "attn_v", h)
        q, k, v = q.reshape(len(tokens), heads, -1), k.reshape(len(tokens), kv, -1), v.reshape(len(tokens), kv, -1)
        if b + "attn_q_norm.weight" in w:  # qwen3
            q, k = rms_norm(q, w[b + "attn_q_norm.weight"], eps), rms_norm(k, w[b + "attn_k_norm.weight"], eps)
        q = rope(q, base, arch in NEOX_ARCHS, factors=factors, mscale=mscale, dims=rot)
        k = rope(k, base, arch in NEOX_ARCHS, factors=factors, mscale=mscale, dims=rot)
        x = x + linear(w, b + "attn_output", attention(q, k, v))
        h = rms_norm(x, w[b + "ffn_norm.weight"], eps)
        if b + "ffn_gate.weight" in w:
            g, u = linear(w, b + "ffn_gate", h), linear(w, b + "ffn_up", h)
        else:  # phi3: one matrix, gate then up (ggml_swiglu of its halves)
            g, u = np.split(linear(w, b + "ffn_up", h), 2, axis=-1)
        x = x + linear(w, b + "ffn_down", g / (1 + np.exp(-g)) * u)
    x = rms_norm(x, w["output_norm.weight"], eps)
    return x @ w.get("output.weight", w["token_embd.weight"]).T


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def gemma3_logits(w, m, tokens):
    heads, kv, layers = int(m("attention.head_count")), int(m("attention.head_count_kv")), int(m("block_count"))
    hidden, eps = int(m("embedding_length")), float(m("attention.layer_norm_rms_epsilon"))
    head_dim = int(m("attention.key_length"))
    window = int(m("attention.sliding_window", 0) or 0)
    scale = 1 / np.sqrt(hidden // heads if layers == 62 else head_dim)
    factor = float(m("rope.scaling.factor", 1.0)) if m("rope.scaling.type") == "linear" else 1.0
    t = len(tokens)
    x = w["token_embd.weight"][np.asarray(tokens)] * np.float32(np.sqrt(hidden))
    for i in range(layers):
        b = f"blk.{i}."
        local = window > 0 and i % 6 < 5
        base, pos_scale = (10000.0, 1.0) if local else (float(m("rope.freq_base", 1e6)), 1 / factor)
        h = rms_norm(x, w[b + "attn_norm.weight"], eps)
        q = rms_norm(linear(w, b + "attn_q", h).reshape(t, heads, -1), w[b + "attn_q_norm.weight"], eps)
        k = rms_norm(linear(w, b + "attn_k", h).reshape(t, kv, -1), w[b + "attn_k_norm.weight"], eps)
        v = linear(w, b + "attn_v", h).reshape(t, kv, -1)
        q, k = rope(q, base, True, pos_scale), rope(k, base, True, pos_scale)
        a = linear(w, b + "attn_output", attention(q, k, v, scale, window if local else None))
        x = x + rms_norm(a, w[b + "post_attention_norm.weight"], eps)
        h = rms_norm(x, w[b + "ffn_norm.weight"], eps)
        f = linear(w, b + "ffn_down", gelu_tanh(linear(w, b + "ffn_gate", h)) * linear(w, b + "ffn_up", h))
        x = x + rms_norm(f, w[b + "post_ffw_norm.weight"], eps)
    x = rms_norm(x, w["output_norm.weight"], eps)
    out = x @ w.get("output.weight", w["token_embd.weight"]).T
    cap = float(m("final_logit_softcapping", 0.0) or 0.0)
    return np.tanh(out / cap) * cap if cap > 0 else out


def gemma2_logits(w, m, tokens):
    heads, kv, layers = int(m("attention.head_count")), int(m("attention.head_count_kv")), int(m("block_count"))
    hidden, eps = int(m("embedding_length")), float(m("attention.layer_norm_rms_epsilon"))
    head_dim = int(m("attention.key_length", hidden // heads))
    window = int(m("attention.sliding_window", 4096) or 4096)
    cap, final_cap = float(m("attn_logit_softcapping", 50.0)), float(m("final_logit_softcapping", 30.0))
    scale = 1 / np.sqrt(hidden // heads if layers == 46 else head_dim)
    base, t = float(m("rope.freq_base", 10000.0)), len(tokens)
    x = w["token_embd.weight"][np.asarray(tokens)] * np.float32(np.sqrt(hidden))
    for i in range(layers):
        b = f"blk.{i}."
        h = rms_norm(x, w[b + "attn_norm.weight"], eps)
        q = rope(linear(w, b + "attn_q", h).reshape(t, heads, -1), base, True)
        k = rope(linear(w, b + "attn_k", h).reshape(t, kv, -1), base, True)
        v = linear(w, b + "attn_v", h).reshape(t, kv, -1)
        a = linear(w, b + "attn_output", attention(q, k, v, scale, window if i % 2 == 0 else None, cap))
        x = x + rms_norm(a, w[b + "post_attention_norm.weight"], eps)
        h = rms_norm(x, w[b + "ffn_norm.weight"], eps)
        f = linear(w, b + "ffn_down", gelu_tanh(linear(w, b + "ffn_gate", h)) * linear(w, b + "ffn_up", h))
        x = x + rms_norm(f, w[b + "post_ffw_norm.weight"], eps)
    out = rms_norm(x, w["output_norm.weight"], eps) @ w.get("output.weight", w["token_embd.weight"]).T
    return np.tanh(out / final_cap) * final_cap


def compare(path, model_dir, prompt="What is the capital of France?"):
    """(max |logit difference|, logit std, top-1 agreement, tokens) of a converted model vs ``logits``."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_map

    model, tok = mlx_lm.load(str(model_dir))
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    tokens = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ours = np.array(model(mx.array(tokens)[None])[0].astype(mx.float32))
    ref = logits(path, tokens)
    return float(np.abs(ours - ref).max()), float(ref.std()), float((ours.argmax(-1) == ref.argmax(-1)).mean()), len(tokens)


if __name__ == "__main__":
    diff, std, top1, n = compare(sys.argv[1], sys.argv[2])
    print(f"{n} tokens: max |logit diff| {diff:.3g} (logit std {std:.3g}), top-1 agreement {top1:.3f}")
