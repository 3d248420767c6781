"""Rotation signs folded into the layers before them (vqpipe/layers/fold.py): exact, out of the stored
state, three primitives fewer per decoder layer (CPU, float32)."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from vqpipe.layers import fold, fused
from vqpipe.store import reservoir as R
from experiments.decode_shapes import graph_ops
from vqpipe.decode.step import Decoder
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import quantize_model, split_state
from vqpipe.codec.rotation import make_rotation

PROMPT = [3, 17, 99, 5, 1200, 42, 7, 310, 8, 64, 2, 4000, 11]


_PAIRS = {}


def _pair(source, bits, fresh=False):
    """(unfolded, folded) quantizations of one source, float32; the same codes (deterministic).
    Shared between tests unless ``fresh`` (for tests that change the models)."""
    if not fresh:
        if (source, bits) not in _PAIRS:
            _PAIRS[(source, bits)] = _pair(source, bits, fresh=True)
        return _PAIRS[(source, bits)]
    ref, _ = load(str(source))
    got, _ = load(str(source))
    config = QuantizeConfig(bits, dtype=mx.float32, threads=1, calib_text="none")
    quantize_model(ref, replace(config, fuse=False))
    quantize_model(got, config)
    fused.fuse_model(ref, fold=False)
    return ref, got


def _logits_run(model, steps=6):
    """Prefill logits, then every greedy step's logits (mlx-lm's eager cache)."""
    cache = make_prompt_cache(model)
    out = [np.array(model(mx.array(PROMPT)[None], cache=cache)[0, -1])]
    for _ in range(steps):
        tok = int(np.argmax(out[-1]))
        out.append(np.array(model(mx.array([[tok]]), cache=cache)[0, -1]))
    return out


@pytest.fixture(scope="module", params=["tiny", "tiny-llama"])
def source(request, tiny_source, tiny_llama_source):
    return {"tiny": tiny_source, "tiny-llama": tiny_llama_source}[request.param]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_folded_logits_are_bit_identical(source, bits):
    ref, got = _pair(source, bits)
    layers = len(got.model.layers)
    assert fold.folded_count(ref) == 0 and fold.folded_count(got) == 3 * layers
    a, b = _logits_run(ref), _logits_run(got)
    for i, (x, y) in enumerate(zip(a, b)):  # negations are exact: not close, the same bytes
        assert x.tobytes() == y.tobytes(), f"step {i}: max |diff| {np.abs(x - y).max()}"
    assert len({int(np.argmax(x)) for x in a}) > 1  # the steps go somewhere: they can tell paths apart


def test_compiled_step_same_tokens(tiny_llama_source):
    ref, got = _pair(tiny_llama_source, 3)
    prompt = mx.array(PROMPT)
    for mode in ("whole", "split"):
        want = Decoder(ref, 40, mode).generate(prompt, 8, prefill_step=8)["ids"]
        assert Decoder(got, 40, mode).generate(prompt, 8, prefill_step=8)["ids"] == want, mode


def test_three_primitives_fewer_per_layer(source):
    ref, got = _pair(source, 3)
    counts = []
    for model in (ref, got):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(PROMPT)[None], cache=cache))
        counts.append(graph_ops(model(mx.array([[5]]), cache=cache)))
    layers = len(got.model.layers)
    assert counts[0]["ops"] - counts[1]["ops"] == 3 * layers
    mul = [c["by_primitive"].get("Multiply", 0) for c in counts]
    assert mul[0] - mul[1] == 3 * layers  # the sign multiplies, nothing else


@pytest.mark.parametrize("persist", [True, False], ids=["on", "off"])
def test_stored_state_and_reservoir_unchanged(source, tmp_path, persist):
    ref, got = _pair(source, 3)
    sa, sb = split_state(ref), split_state(got)
    assert sa[0] == sb[0] and sa[1].keys() == sb[1].keys() and sa[2].keys() == sb[2].keys()
    for part in (1, 2):
        for k in sa[part]:
            assert np.array(sa[part][k]).tobytes() == np.array(sb[part][k]).tobytes(), k
    files = []
    for name, model in (("ref", ref), ("got", got)):
        R.save_reservoir(model, tmp_path / f"{name}.vqres", persist_rotation=persist)
        files.append((tmp_path / f"{name}.vqres").read_bytes())
    assert files[0] == files[1]
    x = mx.array(PROMPT)[None]
    loaded = R.load_reservoir(tmp_path / "got.vqres", model_dir=source)
    assert fold.folded_count(loaded) == 3 * len(loaded.model.layers)  # loading folds (the default)
    want = np.array(ref(x).astype(mx.float32))
    assert np.array(loaded(x).astype(mx.float32)).tobytes() == want.tobytes()
    if persist:  # grafted again into the folded model: the new layers are the ones used, refolded
        old = loaded.model.layers[0].mlp.up_proj
        R.graft_reservoir(loaded, tmp_path / "got.vqres")
        assert loaded.model.layers[0].mlp.up_proj is not old
        assert fold.folded_count(loaded) == 3 * len(loaded.model.layers)
        assert np.array(loaded(x).astype(mx.float32)).tobytes() == want.tobytes()


def test_unfold_refold_and_weight_reload(tiny_llama_source):
    ref, got = _pair(tiny_llama_source, 4, fresh=True)
    x = mx.array(PROMPT)[None]
    want = np.array(ref(x))
    fused.unfuse_model(got)
    assert fold.folded_count(got) == 0
    # against the reference unfused too: a fused product's rounding may depend on its width
    fused.unfuse_model(ref)
    assert np.array(got(x)).tobytes() == np.array(ref(x)).tobytes()
    fused.fuse_model(ref, fold=False)
    assert np.array(ref(x)).tobytes() == want.tobytes()
    fused.fuse_model(got)  # groups again over the views, folded again
    assert fold.folded_count(got) == 3 * len(got.model.layers)
    assert fold.fold_model(got) == 3 * len(got.model.layers)  # idempotent
    assert np.array(got(x)).tobytes() == want.tobytes()
    # new norm weights loaded into both: the folded norm follows its parameter
    new = [(f"model.layers.{i}.{n}.weight", mx.random.uniform(0.5, 1.5, (512,), key=mx.random.key(i)))
           for i in range(len(got.model.layers)) for n in ("input_layernorm", "post_attention_layernorm")]
    for m in (ref, got):
        m.load_weights(new, strict=False)
    assert isinstance(got.model.layers[0].input_layernorm, fold.SignedRMSNorm)
    assert np.array(got(x)).tobytes() == np.array(ref(x)).tobytes()


def test_layers_called_alone_keep_their_meaning(tiny_llama_source):
    """Only inputs made by a folded norm drop the signs: a projection (or the MLP) called on any
    other array computes what the unfolded one does."""
    ref, got = _pair(tiny_llama_source, 4)
    a, b = ref.model.layers[1], got.model.layers[1]
    assert isinstance(b.mlp, fold.SignedMLP) and not isinstance(a.mlp, fold.SignedMLP)
    x = mx.random.normal((1, 3, 512), key=mx.random.key(9))
    h = mx.random.normal((1, 3, 1472), key=mx.random.key(10))
    pairs = [(a.self_attn.q_proj(x), b.self_attn.q_proj(x)), (a.mlp.up_proj(x), b.mlp.up_proj(x)),
             (a.mlp.gate_proj(x), b.mlp.gate_proj(x)), (a.mlp.down_proj(h), b.mlp.down_proj(h)), (a.mlp(x), b.mlp(x))]
    for i, (want, have) in enumerate(pairs):
        assert np.array(want).tobytes() == np.array(have).tobytes(), i
    # the folded norm's own output is the one thing that differs: the signs times the norm
    s = np.array(got.model.layers[1].mlp.gate_proj.rotation.sign_vector())
    y = np.array(b.post_attention_layernorm(x))
    assert np.array_equal(y, np.array(a.post_attention_layernorm(x)) * s) and (s < 0).any()


def test_unsigned_rotation():
    for dim in (512, 4864):  # hadamard; kron 19 x 256
        r = make_rotation("auto", dim, seed=4)
        u = r.unsigned()
        x = mx.random.normal((3, dim), key=mx.random.key(dim))
        dx = x * r.sign_vector()
        assert np.array(u.apply(dx)).tobytes() == np.array(r.apply(x)).tobytes()
        assert np.array(u.apply_transpose(r.apply(x)) * r.sign_vector()).tobytes() == \
            np.array(r.apply_transpose(r.apply(x))).tobytes()
        assert r.signed and r.to_state()  # the original is untouched and storable
        with pytest.raises(ValueError, match="not stored"):
            u.to_state()
        with pytest.raises(ValueError, match="no signs"):
            u.unsigned()
    with pytest.raises(ValueError, match="no signs"):
        make_rotation("qr", 8).unsigned()


@pytest.mark.gpu
@pytest.mark.skipif(__import__("vqpipe.kernels.qmv").kernels.qmv.backend() is None, reason="needs MLX's Metal or CUDA backend")
@pytest.mark.parametrize("rotate_in_kernel", [False, True], ids=["mlx-rotation", "prologue"])
def test_folded_kernel_decode_bit_identical(tiny_llama_source, rotate_in_kernel):
    """With the qmv kernel (signs of ones in its prologue, or the MLX rotation without the multiply)
    and up_proj's flipped scales: the same logits, bit for bit, as the unfolded model."""
    from vqpipe.kernels import qmv

    ref, got = _pair(tiny_llama_source, 4)
    with qmv.enabled(True), qmv.rotating_in_kernel(rotate_in_kernel):
        a, b = _logits_run(ref, 8), _logits_run(got, 8)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.tobytes() == y.tobytes(), f"step {i}: max |diff| {np.abs(x - y).max()}"


def test_module_swaps_fall_back_to_the_plain_forward(tiny_llama_source):
    """bench-quality's dense copy swaps every quantized layer for an nn.Linear: the folded norms
    and MLPs then compute as the plain ones (else the linears would read signed inputs)."""
    from vqpipe.stages.bench_quality import dense_copy

    ref, got = _pair(tiny_llama_source, 4, fresh=True)
    x = mx.array(PROMPT)[None]
    a, b = dense_copy(ref), dense_copy(got)
    assert isinstance(b.model.layers[0].input_layernorm, fold.SignedRMSNorm)
    assert not b.model.layers[0].input_layernorm.intact()
    assert np.array(b(x)).tobytes() == np.array(a(x)).tobytes()
