"""numpy exponentials for CPU evaluation: the same attention, SwiGLU and log-softmax as MLX's, to rounding."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from vqpipe.quant import cpu_eval


def qkv(n=7, s=7, hq=6, hk=2, d=16, seed=0):
    k = mx.random.key(seed)
    kq, kk, kv = mx.random.split(k, 3)
    return (mx.random.normal((2, hq, n, d), key=kq), mx.random.normal((2, hk, s, d), key=kk),
            mx.random.normal((2, hk, s, d), key=kv))


@pytest.mark.parametrize("mask", ["causal", None, "bool", "additive"])
@pytest.mark.parametrize("n,s", [(7, 7), (1, 9), (3, 9), (70, 70), (33, 100)])  # > BLOCK rows: blocks
def test_attention_matches_mlx(mask, n, s):
    q, k, v = qkv(n, s)
    m = mask
    if mask == "bool":
        m = mx.array(np.random.default_rng(1).random((2, 1, n, s)) > 0.3) | mx.eye(n, s, k=s - n, dtype=mx.bool_)
    elif mask == "additive":
        m = mx.array(np.random.default_rng(2).normal(size=(n, s)).astype(np.float32))
    if mask == "causal" and n > s:
        pytest.skip("causal needs n <= s")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=m)
    got = cpu_eval.attention(q, k, v, 0.3, m)
    assert got.dtype == q.dtype and got.shape == want.shape
    assert mx.abs(got - want).max().item() < 1e-5


def test_causal_blocks_see_only_their_keys():
    """Every query row of every block attends to exactly the keys at or before it: moving a later
    key or value changes nothing before it."""
    q, k, v = qkv(3 * cpu_eval.BLOCK + 5, 3 * cpu_eval.BLOCK + 5)
    base = np.asarray(cpu_eval.attention(q, k, v, 0.3, "causal"))
    j = cpu_eval.BLOCK + 7
    k2, v2 = k.at[:, :, j].add(5.0), v.at[:, :, j].add(5.0)
    moved = np.asarray(cpu_eval.attention(q, k2, v2, 0.3, "causal"))
    assert np.array_equal(moved[:, :, :j], base[:, :, :j]) and not np.allclose(moved[:, :, j:], base[:, :, j:])
    with pytest.raises(ValueError, match="queries <= keys"):
        cpu_eval.attention(*qkv(5, 3), 0.3, "causal")


def test_swiglu_and_log_softmax():
    g, x = mx.random.normal((5, 33)) * 4, mx.random.normal((5, 33))
    assert mx.abs(cpu_eval.swiglu(g, x) - nn.silu(g) * x).max().item() < 1e-5
    # rows at a time (any count, a partial last block): the whole-array formula's values exactly
    gn, xn = np.asarray(g), np.asarray(x)
    whole = np.exp(-gn)
    whole += 1
    whole = gn / whole * xn
    for rows in (1, 2, 32):
        assert np.array_equal(np.asarray(cpu_eval.swiglu(g, x, rows=rows)), whole)
    assert cpu_eval.swiglu(g[None], x[None]).shape == (1, 5, 33)
    logits = np.random.default_rng(0).normal(0, 6, (4, 49152)).astype(np.float32)
    z = logits.astype(np.float64)
    want = z - z.max(-1, keepdims=True)
    want -= np.log(np.exp(want).sum(-1, keepdims=True))
    assert np.abs(cpu_eval.log_softmax(mx.array(logits)) - want).max() < 2e-5
    # rows at a time: the same values as the whole array at once, any row count
    z = logits[:3] - logits[:3].max(-1, keepdims=True)
    z -= np.log(np.exp(z).sum(-1, keepdims=True))
    assert np.array_equal(cpu_eval.log_softmax(mx.array(logits[:3]), rows=2), z)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims,d", [(64, 64), (32, 64), (16, 16)])  # dims < d: the rest passes through
@pytest.mark.parametrize("base,scale,offset", [(10000.0, 1.0, 0), (100000.0, 1.0, 0), (1234.5, 0.25, 7), (1e7, 1.0, 3)])
def test_rope_is_mlx_rope_bit_for_bit(traditional, dims, d, base, scale, offset):
    """MLX's own cos/sin table and the fallback's elementwise order: the same bits as mx.fast.rope,
    for transposed views (how attention hands q and k over) and plain arrays."""
    x = mx.random.normal((2, 70, 3, d), key=mx.random.key(dims + d)).transpose(0, 2, 1, 3)
    for a in (x, mx.contiguous(x)):
        kw = {"traditional": traditional, "base": base, "scale": scale, "offset": offset}
        want = np.asarray(mx.fast.rope(a, dims, **kw))
        assert np.asarray(cpu_eval.rope(a, dims, **kw)).tobytes() == want.tobytes()
    freqs = mx.linspace(1.0, 400.0, dims // 2)
    kw = {"traditional": traditional, "base": None, "scale": scale, "offset": offset, "freqs": freqs}
    assert np.array_equal(np.asarray(cpu_eval.rope(x, dims, **kw)), np.asarray(mx.fast.rope(x, dims, **kw)))


def test_rope_leaves_what_it_does_not_cover_to_mlx(monkeypatch):
    """bf16 inputs and a KV cache's array offset go to MLX's rope as they came."""
    calls = []
    monkeypatch.setattr(cpu_eval, "_MX_ROPE", lambda *a, **k: calls.append(k["offset"]) or a[0])
    x = mx.random.normal((1, 2, 5, 16))
    cpu_eval.rope(x.astype(mx.bfloat16), 16, traditional=False, base=1e4, scale=1.0, offset=0)
    cpu_eval.rope(x, 16, traditional=False, base=1e4, scale=1.0, offset=mx.array(3))
    assert len(calls) == 2 and isinstance(calls[1], mx.array)


def test_patch_is_scoped_and_the_forward_agrees():
    from mlx_lm.models import llama

    from test_reservoir import make_model

    model, _ = make_model({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                           "num_attention_heads": 4, "num_key_value_heads": 2})
    tokens = mx.array([[1, 5, 9, 2, 77, 31, 4, 100]])
    want = model(tokens)
    sdpa, glu, rope = mx.fast.scaled_dot_product_attention, llama.swiglu, mx.fast.rope
    with cpu_eval.numpy_exponentials():
        assert mx.fast.scaled_dot_product_attention is cpu_eval.attention and llama.swiglu is cpu_eval.swiglu
        assert mx.fast.rope is cpu_eval.rope
        got = model(tokens)
    assert mx.fast.scaled_dot_product_attention is sdpa and llama.swiglu is glu and mx.fast.rope is rope
    assert mx.abs(got - want).max().item() < 1e-4 * max(1.0, mx.abs(want).max().item())
    with pytest.raises(ValueError, match="sinks"):
        cpu_eval.attention(*qkv(), 0.3, None, sinks=mx.zeros((6,)))


@pytest.mark.parametrize("arch", [{"model_type": "llama", "tie_word_embeddings": True},
                                  {"model_type": "llama", "tie_word_embeddings": False},
                                  {"model_type": "qwen2", "tie_word_embeddings": False}])
def test_window_logprobs_head_in_numpy_matches_the_model(arch):
    """The head multiplied by numpy into the output buffer: the log-softmax of the model's own
    logits (its numpy-exponential forward), to rounding; a buffer of the wrong shape is replaced."""
    from test_reservoir import make_model

    model, _ = make_model({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                           "num_key_value_heads": 2, **arch})
    assert cpu_eval.head_weight(model) is not None
    tokens = mx.array([1, 5, 9, 2, 77, 31, 4, 100, 3, 8])
    with cpu_eval.numpy_exponentials():
        want = cpu_eval.log_softmax(model(tokens[None])[0])
    buf = np.zeros((3, 3), np.float32)
    got = cpu_eval.window_logprobs(model, tokens, out=buf)
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-5
    first = got.copy()
    again = cpu_eval.window_logprobs(model, tokens, out=got)  # reused: written in place, same values
    assert np.shares_memory(again, got) and np.array_equal(again, first)


def test_window_logprobs_falls_back_for_other_heads():
    from test_reservoir import make_model

    model, _ = make_model({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False})
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda p, m: p == "lm_head")
    assert cpu_eval.head_weight(model) is None
    tokens = mx.array([1, 5, 9, 2, 77])
    with cpu_eval.numpy_exponentials():
        want = cpu_eval.log_softmax(model(tokens[None])[0])
    assert np.array_equal(cpu_eval.window_logprobs(model, tokens), want)
