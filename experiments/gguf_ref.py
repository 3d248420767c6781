"""An independent evaluation of a GGUF file: a float32 NumPy forward pass in llama.cpp's conventions.

It shares no code with the converter (vqpipe/sources/gguf.py): weights are dequantized by the ``gguf``
package (not MLX), Q/K stay in llama.cpp's permuted row order and RoPE rotates adjacent pairs
(llama.cpp's "normal" mode) for llama, halves ("neox" mode) for qwen2 and qwen3 (which also
normalises each head of q and k by its own RMSNorm before RoPE). If the converted model's
logits match these, the permutation was undone correctly.

    python -m experiments.gguf_ref FILE CONVERTED_DIR   # compares the two on a chat prompt
"""

import sys

import numpy as np

NEOX_ARCHS = ("qwen2", "qwen3")


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


def rope(x, base, neox):
    """x: [T, heads, D]; llama.cpp's rotary embedding at positions 0..T-1."""
    t, _, d = x.shape
    freqs = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(t)[:, None] * freqs[None]
    cos, sin = np.cos(ang)[:, None].astype(np.float32), np.sin(ang)[:, None].astype(np.float32)
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def attention(q, k, v):
    """Causal GQA attention; q [T, H, D], k/v [T, KV, D]."""
    t, h, d = q.shape
    rep = h // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v).reshape(t, h * d)


def linear(w, name, x):
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y


def logits(path, tokens):
    """float32 logits [T, vocab] of the GGUF model on ``tokens``."""
    meta, w = read(path)
    arch = meta["general.architecture"]
    m = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    heads, kv = int(m("attention.head_count")), int(m("attention.head_count_kv", m("attention.head_count")))
    eps, base = float(m("attention.layer_norm_rms_epsilon")), float(m("rope.freq_base", 10000.0))
    x = w["token_embd.weight"][np.asarray(tokens)]
    for i in range(int(m("block_count"))):
        b = f"blk.{i}."
        h = rms_norm(x, w[b + "attn_norm.weight"], eps)
        q = linear(w, b + "attn_q", h).reshape(len(tokens), heads, -1)
        k = linear(w, b + "attn_k", h).reshape(len(tokens), kv, -1)
        v = linear(w, b + "attn_v", h).reshape(len(tokens), kv, -1)
        if b + "attn_q_norm.weight" in w:  # qwen3
            q, k = rms_norm(q, w[b + "attn_q_norm.weight"], eps), rms_norm(k, w[b + "attn_k_norm.weight"], eps)
        q, k = rope(q, base, arch in NEOX_ARCHS), rope(k, base, arch in NEOX_ARCHS)
        x = x + linear(w, b + "attn_output", attention(q, k, v))
        h = rms_norm(x, w[b + "ffn_norm.weight"], eps)
        g, u = linear(w, b + "ffn_gate", h), linear(w, b + "ffn_up", h)
        x = x + linear(w, b + "ffn_down", g / (1 + np.exp(-g)) * u)
    x = rms_norm(x, w["output_norm.weight"], eps)
    return x @ w.get("output.weight", w["token_embd.weight"]).T


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
