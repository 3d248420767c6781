"""The compiled decode step over a static KV cache (vqpipe/decode/step.py) against mlx-lm's eager
decode, float32 on the CPU: full precision, MLX affine and vqpipe weights."""

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import RotatingKVCache

from vqpipe.decode.step import Decoder, StaticCache, check_model, write_kv
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import quantize_model
from vqpipe.stages.bench_decode import cast_floating, generate_once, make_cache

PROMPT_LENGTHS = (1, 5, 23)  # 1: no prefill at all; 23 with prefill_step 8: three chunks
NEW = 10


def _prompts(vocab):
    return [mx.random.randint(0, vocab - 16, (n,), key=mx.random.key(40 + n)) for n in PROMPT_LENGTHS]


def _same_as_eager(model, vocab, capacity=48, mode="whole"):
    dec = Decoder(model, capacity, mode)
    seen = set()
    for prompt in _prompts(vocab):
        ref = generate_once(model, prompt, make_cache(model, "fp", 4, 32, 0), NEW, 8)["ids"]
        got = dec.generate(prompt, NEW, prefill_step=8)
        assert got["ids"] == ref, f"P={prompt.size}"
        assert got["prefill_s"] > 0 and got["decode_s"] > 0
        seen.update(ref)
    assert len(seen) > 3  # the prompts lead to different texts: the comparison can tell paths apart
    # one trace (per block in split mode) serves every prompt length and every position
    assert dec.traces == (len(model.layers) if mode == "split" else 1)
    return dec


MODES = ("whole", "split")


@pytest.fixture(scope="module")
def tiny_f32(tiny_source):
    model, _ = load(str(tiny_source))
    return cast_floating(model, mx.float32)


@pytest.mark.parametrize("mode", MODES)
def test_full_precision_qwen2_matches_eager(tiny_f32, mode):
    _same_as_eager(tiny_f32, 8192, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_full_precision_llama_matches_eager(tiny_llama_source, mode):
    model, _ = load(str(tiny_llama_source))
    _same_as_eager(cast_floating(model, mx.float32), 8192, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_affine_matches_eager(tiny_4bit_source, mode):
    model, _ = load(str(tiny_4bit_source))
    _same_as_eager(cast_floating(model, mx.float32), 8192, mode=mode)


@pytest.fixture(scope="module")
def tiny_llama_vq3(tiny_llama_source):
    # quantized once for both modes: a decode leaves the model's weights as they were
    model, _ = load(str(tiny_llama_source))
    quantize_model(model, QuantizeConfig(3, dtype=mx.float32, threads=1, calib_text="none"))
    return model


@pytest.mark.parametrize("mode", MODES)
def test_vqpipe_matches_eager(tiny_llama_vq3, mode):
    _same_as_eager(tiny_llama_vq3, 8192, mode=mode)


def test_uncompiled_static_step_is_the_same(tiny_f32):
    prompt = _prompts(8192)[2]
    a = Decoder(tiny_f32, 40, "eager").generate(prompt, NEW, 8)
    b = Decoder(tiny_f32, 40).generate(prompt, NEW, 8)
    c = Decoder(tiny_f32, 40, "split").generate(prompt, NEW, 8)
    assert a["ids"] == b["ids"] == c["ids"]


@pytest.mark.parametrize("mode", MODES)
def test_tokens_streams_any_count_with_mlx_lm_logprobs(tiny_f32, mode):
    """``tokens`` for 1 and for NEW new tokens (one token ran past the end of its loop: 2026-12-07),
    and with ``logprobs`` the distributions mlx-lm's generate_step yields beside the same ids."""
    from mlx_lm.generate import generate_step

    prompt = _prompts(8192)[1]
    dec = Decoder(tiny_f32, 40, mode)
    ids = list(dec.tokens(prompt, NEW, 8))
    assert list(dec.tokens(prompt, 1, 8)) == ids[:1]
    pairs = list(dec.tokens(prompt, NEW, 8, logprobs=True))
    assert [i for i, _ in pairs] == ids
    ref = list(generate_step(prompt, tiny_f32, max_tokens=NEW, prefill_step_size=8))
    assert [int(t) for t, _ in ref] == ids
    for (_, lp), (_, want) in zip(pairs, ref):
        assert lp.shape == want.shape == (8192,)
        assert mx.allclose(lp, want, atol=1e-4).item()


@pytest.mark.parametrize("mode", MODES)
def test_tokens_from_a_prefix_are_the_tokens_of_the_whole_prompt(tiny_f32, mode):
    """``prefix``: the keys and values of the prompt's first positions (as mlx-lm's KVCache holds
    them) written first, the rest prefilled: the same ids and log-probabilities as from scratch, and
    ``kv`` holds the positions written."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt = _prompts(8192)[2]  # 23 tokens
    dec = Decoder(tiny_f32, 48, mode)
    whole = list(dec.tokens(prompt, NEW, 8, logprobs=True))
    assert dec.position == prompt.size + NEW - 1 and dec.kv is not None
    cache = make_prompt_cache(tiny_f32)
    tiny_f32(prompt[None, :17], cache=cache)
    prefix = [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) for c in cache]
    part = list(dec.tokens(prompt[17:], NEW, 8, logprobs=True, prefix=prefix))
    assert [i for i, _ in part] == [i for i, _ in whole]
    for (_, a), (_, b) in zip(part, whole):
        assert mx.allclose(a, b, atol=1e-4).item()
    with pytest.raises(ValueError, match="a 23-token prompt and 26 new tokens need 49 KV positions"):
        next(dec.tokens(prompt[17:], 26, 8, prefix=prefix))


def test_paced_prefill_writes_the_same_cache(tiny_llama_vq3):
    """Prefill with its blocks paced (``pace`` blocks queued ahead of the one waited for) writes the
    same keys and values, bit for bit, as the whole chunk queued at once, over several chunks; the
    model's blocks are its own again afterwards, and a bad pace is refused before anything runs."""
    model = tiny_llama_vq3
    blocks = model.model.layers
    prompt = _prompts(8192)[2]  # 23 tokens: three chunks of 8
    dec = Decoder(model, 32, "split")
    got = {}
    for pace in (0, 1, 2, 5, 40):
        caches = dec.new_cache()
        token, done = dec.prefill(prompt, caches, 8, pace=pace)
        assert done == 22 and token.tolist() == [[prompt[22].item()]]
        got[pace] = [(c.keys, c.values) for c in caches]
        assert model.model.layers is blocks
    for pace in (1, 2, 5, 40):
        for (k, v), (k0, v0) in zip(got[pace], got[0]):
            assert mx.array_equal(k, k0).item() and mx.array_equal(v, v0).item()
    assert mx.any(got[0][0][0][..., :22, :] != 0).item()  # something was written
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefill pace must be a whole number of blocks"):
            dec.prefill(prompt, dec.new_cache(), 8, pace=bad)
    assert model.model.layers is blocks


def test_prefill_waits_by_default_only_where_it_decodes_weights_on_a_gpu(tiny_llama_vq3, tiny_f32, monkeypatch):
    """The default waits: none on the CPU; on a GPU only for a vqpipe model's chunks of more rows
    than the trellis mat-vec takes (those run the dense path), each time PACE_BYTES of decoded
    weights were queued; never for a model with no vqpipe layers."""
    from vqpipe.decode import step
    from vqpipe.kernels import ext

    vq, fp = Decoder(tiny_llama_vq3, 32), Decoder(tiny_f32, 32)
    n = len(tiny_llama_vq3.model.layers)
    above = ext.GPU_MAX_M + 1
    assert vq.waits(above, mx.cpu) == [False] * n and vq.waits(ext.GPU_MAX_M, mx.gpu) == [False] * n
    assert fp.waits(above, mx.gpu) == [False] * len(tiny_f32.model.layers)
    vq.waits(above, mx.gpu)
    per_block = vq._block_bytes
    assert n >= 2 and len(per_block) == n and all(b == per_block[0] > 0 for b in per_block)
    monkeypatch.setattr(step, "PACE_BYTES", per_block[0] + 1)  # a wait every second block
    assert vq.waits(above, mx.gpu) == [(i + 1) % 2 == 0 for i in range(n)]
    monkeypatch.setattr(step, "PACE_BYTES", n * per_block[0] + 1)  # more than the model decodes: none
    assert vq.waits(above, mx.gpu) == [False] * n
    monkeypatch.setattr(step, "PACE_BYTES", 1)  # a block above the budget: a wait after each
    assert vq.waits(above, mx.gpu) == [True] * n


def test_capacity_is_exact_and_overflow_is_refused(tiny_f32):
    prompt = _prompts(8192)[1]  # 5 tokens
    dec = Decoder(tiny_f32, 5 + NEW)
    assert len(dec.generate(prompt, NEW, 8)["ids"]) == NEW  # exactly fills the cache
    with pytest.raises(ValueError, match="need 16 KV positions; the static cache holds 15"):
        dec.generate(prompt, NEW + 1, 8)
    for mode in MODES:  # stepping on past the end is refused before anything is queued
        d = Decoder(tiny_f32, 6, mode)
        args = d.start(prompt, 8)
        for _ in range(2):
            args = d.step(*args)[:3]
        with pytest.raises(ValueError, match="static KV cache full: position 6, capacity 6"):
            d.step(*args)
    with pytest.raises(ValueError, match="call start"):
        Decoder(tiny_f32, 6).step(*args)
    caches = dec.new_cache()
    with pytest.raises(ValueError, match="static KV cache full: 20 positions needed, capacity 15"):
        tiny_f32(mx.zeros((1, 20), mx.int32), cache=caches)
    with pytest.raises(ValueError, match="capacity must be >= 2"):
        Decoder(tiny_f32, 1)
    with pytest.raises(ValueError, match="decode mode must be one of"):
        Decoder(tiny_f32, 8, "graph")
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate(mx.zeros((0,), mx.int32), 2, 8)


def test_mask_covers_written_positions_only():
    c = StaticCache(mx.zeros((1, 2, 6, 4)), mx.zeros((1, 2, 6, 4)), mx.array(2, mx.int32))
    assert c.make_mask(1).reshape(-1).tolist() == [True, True, True, False, False, False]
    with pytest.raises(ValueError, match="one token"):
        c.make_mask(3)
    with pytest.raises(ValueError, match="sliding-window"):
        c.make_mask(1, window_size=4)


def test_sliding_window_models_are_refused():
    class Windowed:
        layers = [None]

        def make_cache(self):
            return [RotatingKVCache(max_size=16)]

    with pytest.raises(ValueError, match="full-attention KVCache layers only.*RotatingKVCache"):
        check_model(Windowed())


@pytest.mark.parametrize("mode", MODES)
def test_step_logits_match_eager_within_float32(tiny_llama_source, mode):
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(tiny_llama_source))
    model = cast_floating(model, mx.float32)
    prompt = _prompts(8192)[2]
    dec = Decoder(model, 40, mode)
    token, pos, state = dec.start(prompt, 8)
    ref_cache = make_prompt_cache(model)
    model(prompt[:-1][None], cache=ref_cache)
    for _ in range(6):
        ref = model(token, cache=ref_cache)[:, -1, :]
        nxt, pos, state, logits = dec.step(token, pos, state)
        scale = mx.abs(ref).max().item()
        assert mx.abs(logits - ref).max().item() <= 1e-5 * scale
        token = nxt


@pytest.mark.gpu
@pytest.mark.skipif(__import__("vqpipe.kernels.qmv").kernels.qmv.backend() is None, reason="needs MLX's Metal or CUDA backend")
@pytest.mark.parametrize("rot", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_kernel_inside_compiled_step_same_tokens(tiny_llama_source, rot, mode):
    from vqpipe.kernels import qmv
    from experiments.decode_shapes import graph_ops

    model, _ = load(str(tiny_llama_source))
    # scalar codes: the qmv kernel under test (trellis layers take the extension's own primitive)
    quantize_model(model, QuantizeConfig(4, dtype=mx.float32, threads=1, calib_text="none", codes="scalar"))
    with qmv.enabled(True), qmv.rotating_in_kernel(rot):
        dec = _same_as_eager(model, 8192, mode=mode)
        out = dec.step(*dec.start(_prompts(8192)[2], 8))
        assert graph_ops(out[0])["by_primitive"].get("CustomKernel", 0) >= 4 * len(model.layers)


@pytest.fixture(scope="module")
def reservoir(tiny_b4_reservoir):
    return tiny_b4_reservoir


@pytest.mark.parametrize("mode", MODES)
def test_generate_cli_compiled_matches_mlx_lm(reservoir, capsys, mode):
    from mlx_lm import generate as mlx_generate

    from vqpipe.apps import generate

    assert generate.main(["--model", str(reservoir), "--prompt", "Hello sea", "-m", "8", "--compiled", mode]) == 0
    out = capsys.readouterr().out
    text = out.split("==========\n")[1].rstrip("\n")
    model, tok = generate.load_model(reservoir)
    prompt = generate.encode_prompt(tok, "Hello sea", True)
    assert text == mlx_generate(model, tok, prompt, max_tokens=8)
    assert f"Prompt: {len(prompt)} tokens" in out and f"(compiled step, {mode})" in out


def test_generate_cli_compiled_refuses_sampling(reservoir, capsys):
    from vqpipe.apps import generate

    for extra in (["--temp", "0.7"], ["--kv-bits", "4", "--kv-cache", "reference"]):
        with pytest.raises(SystemExit):
            generate.main(["--model", str(reservoir), "--prompt", "x", "--compiled", "whole", *extra])
        assert "--compiled decodes greedily" in capsys.readouterr().err


def test_write_kv_writes_one_position_only():
    """put_along_axis at a device position writes what slice_update there would, and nothing else."""
    buf = mx.random.normal((1, 3, 9, 4))
    new = mx.random.normal((1, 3, 1, 4))
    out = write_kv(buf, new, mx.array(6, mx.int32))
    assert mx.array_equal(out, mx.slice_update(buf, new, mx.array([6]), axes=(2,))).item()
    keep = mx.concatenate([out[:, :, :6], out[:, :, 7:]], axis=2)
    assert mx.array_equal(keep, mx.concatenate([buf[:, :, :6], buf[:, :, 7:]], axis=2)).item()


@pytest.mark.parametrize("mode", MODES)
def test_position_is_padded_out_of_the_small_pool(tiny_llama_source, mode):
    """The position is a padded vector (longer than MLX's 8-byte small pool) whose entry 0 advances."""
    from vqpipe.kernels import small_arrays

    model, _ = load(str(tiny_llama_source))
    model = cast_floating(model, mx.float32)
    prompt = _prompts(8192)[2]
    dec = Decoder(model, 32, mode)
    token, pos, state = dec.start(prompt, 8)
    assert pos.nbytes > small_arrays.POOL_BYTES
    for _ in range(4):
        token, pos, state, logits = dec.step(token, pos, state)
    assert pos.tolist()[0] == prompt.size - 1 + 4


def test_generate_takes_the_compiled_split_step_on_cpu_and_cuda(monkeypatch):
    """``--compiled auto``: split on the CPU and CUDA for greedy decoding with the full-precision
    cache; the eager loop on Metal, for sampling and for the KIVI caches."""
    import argparse

    import mlx.core as mx

    from vqpipe.apps.generate import auto_compiled

    greedy = argparse.Namespace(temp=0.0, kv_bits=None)
    assert auto_compiled(greedy, mx.cpu) == "split"
    assert auto_compiled(argparse.Namespace(temp=0.7, kv_bits=None), mx.cpu) is None
    assert auto_compiled(argparse.Namespace(temp=0.0, kv_bits=4), mx.cpu) is None
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)  # a GPU that is not CUDA: Metal
    assert auto_compiled(greedy, mx.gpu) is None
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert auto_compiled(greedy, mx.gpu) == "split"
    assert auto_compiled(argparse.Namespace(temp=0.7, kv_bits=None), mx.gpu) is None
    assert auto_compiled(argparse.Namespace(temp=0.0, kv_bits=4), mx.gpu) is None


def test_serve_decodes_a_lone_request_compiled_on_cpu_and_cuda(monkeypatch):
    """serve's ``--decode auto``: the compiled step for a lone greedy request on the CPU and CUDA,
    mlx-lm's batch loop on Metal; only greedy requests without logit processors qualify."""
    import mlx.core as mx
    from mlx_lm.server import GenerationArguments, LogitsProcessorArguments, ModelDescription, SamplingArguments

    from vqpipe.apps.serve import compiled_decode, greedy_plain

    assert compiled_decode("auto", mx.cpu)
    assert compiled_decode("compiled", mx.gpu) and not compiled_decode("batched", mx.cpu)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)  # a GPU that is not CUDA: Metal
    assert not compiled_decode("auto", mx.gpu) and compiled_decode("auto", mx.cpu)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert compiled_decode("auto", mx.gpu)

    def args(temperature=0.0, **logits):
        lg = dict(logit_bias=None, repetition_penalty=0.0, repetition_context_size=20, presence_penalty=0.0,
                  presence_context_size=20, frequency_penalty=0.0, frequency_context_size=20)
        return GenerationArguments(ModelDescription("m", "default_model", None),
                                   SamplingArguments(temperature, 1.0, 0, 0.0, 0.0, 0.0),
                                   LogitsProcessorArguments(**{**lg, **logits}), [], 8, 3, False, -1, None, None)

    assert greedy_plain(args()) and greedy_plain(args(repetition_penalty=1.0))
    assert not greedy_plain(args(0.7))
    assert not greedy_plain(args(logit_bias={3: 5.0}))
    assert not greedy_plain(args(repetition_penalty=1.3))
    assert not greedy_plain(args(presence_penalty=0.5))
    assert not greedy_plain(args(frequency_penalty=0.5))
