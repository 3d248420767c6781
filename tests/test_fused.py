"""Siblings computed as one (vqpipe/layers/fused.py), shared rotations, dtypes of unquantized tensors, and
per-group scales on the dense path (CPU)."""

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from vqpipe import blas
from vqpipe.layers import fused
from vqpipe.stages.download import fetch
from vqpipe.codec.bitpack import unpack_numpy
from vqpipe.layers.qlinear import QuantizedEmbedding, QuantizedLinear
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import layer_seed, quantize_model, split_state

FLOAT32 = QuantizeConfig(dtype=mx.float32, threads=1, calib_text="none")  # data-free, every tensor in float32


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("fused")
    return {p: fetch(f"synth:{p}", d / p, seed=0) for p in ("tiny", "tiny-llama")}


def _greedy(model, prompt, steps):
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    out = []
    for _ in range(steps):
        tok = int(mx.argmax(logits).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
    return out


def test_rotation_owner():
    assert fused.rotation_owner("model.layers.3.self_attn.k_proj") == "model.layers.3.self_attn.q_proj"
    assert fused.rotation_owner("model.layers.3.self_attn.q_proj") == "model.layers.3.self_attn.q_proj"
    assert fused.rotation_owner("model.layers.0.mlp.up_proj") == "model.layers.0.mlp.gate_proj"
    assert fused.rotation_owner("model.layers.0.mlp.down_proj") == "model.layers.0.mlp.down_proj"
    assert fused.rotation_owner("v_proj") == "q_proj"


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_fused_equals_unfused_in_float32(sources, preset):
    ref, tok = load(str(sources[preset]))
    got, _ = load(str(sources[preset]))
    quantize_model(ref, replace(FLOAT32, bits=3, fuse=False))
    quantize_model(got, replace(FLOAT32, bits=3))
    layers = ref.model.layers
    assert fused.fused_groups(ref) == {}
    assert len(fused.fused_groups(got)) == 2 * len(layers)  # q|k|v and gate|up per layer
    # siblings share the first one's seed, hence one rotation
    a = layers[0].self_attn
    assert a.q_proj.rotation.seed == a.k_proj.rotation.seed == a.v_proj.rotation.seed
    assert a.q_proj.rotation.seed == layer_seed(0, "model.layers.0.self_attn.q_proj")
    assert layers[0].mlp.up_proj.rotation.seed == layers[0].mlp.gate_proj.rotation.seed
    assert a.o_proj.rotation.seed != a.q_proj.rotation.seed
    prompt = tok.encode("The rotation spreads the outliers over every coordinate")
    x = mx.array(prompt)[None]
    a, b = np.array(ref(x)), np.array(got(x))
    if blas.width_invariant():
        assert np.array_equal(a, b)  # prefill: the dense path, same bytes
    else:  # a fused product rounds differently from its parts here (OpenBLAS Haswell kernels)
        assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
    assert _greedy(ref, prompt, 8) == _greedy(got, prompt, 8)  # decode steps (M = 1)


def test_fused_state_is_unchanged_and_views(sources):
    model, _ = load(str(sources["tiny"]))
    quantize_model(model, replace(FLOAT32, fuse=False))
    before = {k: np.array(v) for k, v in split_state(model)[1].items()}
    assert fused.fuse_model(model) == 4
    assert fused.fuse_model(model) == 0  # idempotent
    after = split_state(model)[1]
    assert set(before) == set(after)
    assert all(np.array_equal(before[k], np.array(after[k])) for k in before)
    a = model.model.layers[0].self_attn
    group = a.q_proj.__dict__["_fused"]
    assert group is a.k_proj.__dict__["_fused"] is a.v_proj.__dict__["_fused"]
    rows_per_packed_row = 32 if a.q_proj.codes == "trellis" else 1  # trellis: a packed row per 32-row tile row
    assert group.packed.shape[0] * rows_per_packed_row == (a.q_proj.out_features + a.k_proj.out_features
                                                           + a.v_proj.out_features)
    assert group.bias is not None  # qwen2: q/k/v biases, concatenated


def test_group_serves_each_sibling_then_holds_nothing(sources):
    model, _ = load(str(sources["tiny-llama"]))
    quantize_model(model, FLOAT32)
    mlp = model.model.layers[1].mlp
    group = mlp.gate_proj.__dict__["_fused"]
    x, x2 = (mx.random.normal((1, 3, 512), key=mx.random.key(k)) for k in (1, 2))
    fused.unfuse_model(model)
    want = {n: mlp[n](x) for n in ("gate_proj", "up_proj")}
    want2 = mlp["up_proj"](x2)
    fused.fuse_model(model)  # the arrays are views already; a new group over them (folded: x is no norm's output)
    group = mlp.gate_proj.__dict__["_fused"]
    g = mlp.gate_proj(x)
    assert group._x is x
    u = mlp.up_proj(x)
    assert group._x is None and group._outs is None  # both served: nothing held
    assert np.array_equal(np.array(mlp.up_proj(x2)), np.array(want2))  # alone on another input
    assert np.array_equal(np.array(g), np.array(want["gate_proj"]))
    assert np.array_equal(np.array(u), np.array(want["up_proj"]))


def test_source_dtype_kept_and_cpu_computes_in_float32(sources):
    model, tok = load(str(sources["tiny"]))  # the synthetic checkpoint is bfloat16
    quantize_model(model, replace(FLOAT32, dtype=None))
    emb = model.model.embed_tokens
    assert isinstance(emb, QuantizedEmbedding) and emb.out_dtype == mx.bfloat16
    assert model.model.norm.weight.dtype == mx.bfloat16
    assert model.model.layers[0].self_attn.k_proj.bias.dtype == mx.bfloat16
    meta, _ = emb.to_state()
    assert meta["dtype"] == "bfloat16"
    with mx.stream(mx.cpu):
        assert emb(mx.array([[1, 2]])).dtype == mx.float32  # CPU: float32 lookups
        assert model(mx.array(tok.encode("hello"))[None]).dtype == mx.float32
    emb2 = QuantizedEmbedding.from_state(meta, emb.to_state()[1])
    assert emb2.out_dtype == mx.bfloat16


def test_group_scales_dense_path():
    rng = np.random.default_rng(0)
    n_in, n_out, gs = 256, 24, 64
    lin = nn.Linear(n_in, n_out, bias=True)
    layer = QuantizedLinear.from_linear(lin, 4, "auto", seed=1)
    scales = rng.uniform(0.5, 1.5, (n_out, n_in // gs)).astype(np.float32)
    grouped = QuantizedLinear(n_in, n_out, 4, layer.rotation, layer.packed, mx.array(scales), layer.codebook,
                              layer.bias, group_size=gs)
    x = mx.random.normal((2, n_in), key=mx.random.key(3))
    with mx.stream(mx.cpu):
        y = grouped(x)
        xr = np.array(layer.rotation.apply(x), dtype=np.float64)
        w = np.array(layer.codebook, dtype=np.float64)[unpack_numpy(np.array(layer.packed), 4, n_in)]
        want = xr @ (w * np.repeat(scales, gs, axis=1)).T + np.array(layer.bias)
        assert np.abs(np.array(y) - want).max() < 1e-4 * np.abs(want).max()
        # the analysis weight agrees with the forward
        dense = np.array(x) @ np.array(grouped.dequantized_weight()).T + np.array(layer.bias)
        assert np.abs(dense - want).max() < 1e-4 * np.abs(want).max()
    meta, arrays = grouped.to_state()
    assert meta["group_size"] == gs
    assert QuantizedLinear.from_state(meta, arrays).group_size == gs


@pytest.mark.gpu
@pytest.mark.skipif(__import__("vqpipe.kernels.qmv").kernels.qmv.backend() is None, reason="needs MLX's Metal or CUDA backend")
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_fused_kernel_decode_same_tokens_in_float32(sources, preset):
    from vqpipe.kernels import qmv

    ref, tok = load(str(sources[preset]))
    got, _ = load(str(sources[preset]))
    quantize_model(ref, replace(FLOAT32, fuse=False))
    quantize_model(got, FLOAT32)
    prompt = tok.encode("The rotation spreads the outliers over every coordinate")
    with qmv.enabled(True):
        a, b = _greedy(ref, prompt, 12), _greedy(got, prompt, 12)
    with qmv.enabled(False):
        c = _greedy(got, prompt, 12)
    assert a == b == c
