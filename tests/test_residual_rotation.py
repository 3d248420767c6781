"""One rotation of the residual stream folded into the weights (vqpipe/quant/residual_rotation.py): the same
function, the stream's readers quantized without rotations of their own, stored and reloaded
byte-exact, fewer primitives per decode step (CPU, float32)."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from vqpipe.store import reservoir as R
from vqpipe.quant import residual_rotation as rr
from experiments.decode_shapes import graph_ops
from vqpipe.decode.step import Decoder
from vqpipe.layers.qlinear import QuantizedEmbedding, QuantizedLinear
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import quantize_model, residual_seed
from vqpipe.stages.bench_decode import cast_floating

PROMPT = [3, 17, 99, 5, 1200, 42, 7, 310, 8, 64, 2, 4000, 11]
# scripts/gpu.sh runs this file on the default device: on CUDA a float32 matmul is TF32 (a 10-bit
# mantissa), so two orders of the same product differ by ~1e-3 of the output's scale, not ~1e-6.
TF32 = mx.default_device() == mx.gpu and mx.cuda.is_available()
RTOL = 2e-3 if TF32 else 2e-5


def _has_text():
    from vqpipe import text

    try:
        return text.package_root() is not None
    except FileNotFoundError:
        return False


def _load(path):
    model, _ = load(str(path))
    return cast_floating(model, mx.float32)


@pytest.fixture(scope="module", params=["tiny", "tiny-llama", "tiny-4bit"])
def source(request, tiny_source, tiny_llama_source, tiny_4bit_source):
    return {"tiny": tiny_source, "tiny-llama": tiny_llama_source, "tiny-4bit": tiny_4bit_source}[request.param]


_Q = {}


def _quantized(source, residual, bits=4):
    """A float32 quantization of ``source`` with or without the residual rotation (shared: read-only)."""
    key = (source, residual, bits)
    if key not in _Q:
        model = _load(source)
        quantize_model(model, QuantizeConfig(bits, dtype=mx.float32, residual=residual, threads=1, calib_text="none"))
        _Q[key] = model
    return _Q[key]


def test_rotation_keeps_the_function(source):
    ref, model = _load(source), _load(source)
    x = mx.array(PROMPT)[None]
    want = ref(x)
    q = rr.rotate_residual(model, 7)
    got = model(x)
    scale = float(mx.max(mx.abs(want)).item())
    assert float(mx.max(mx.abs(got - want)).item()) < RTOL * scale
    assert TF32 or mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1)).item()
    assert rr.of(model) == {"kind": q.kind, "dim": q.dim, "seed": 7} and rr.of(ref) is None
    inner = model.model
    for norm in [inner.norm] + [b[n] for b in inner.layers for n in rr.READERS]:
        assert mx.array_equal(norm.weight, mx.ones_like(norm.weight)).item()
    assert isinstance(inner.embed_tokens, rr.TiedEmbedding) == rr.tied(model)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())  # affine: dequantized


@pytest.mark.parametrize("bits", [2, 4])
def test_stream_readers_quantized_unrotated(source, bits):
    model = _quantized(source, True, bits)
    kinds = {n: m.rotation.kind for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    for name, kind in kinds.items():
        assert (kind == "none") == rr.unrotated(name), name
    assert {k for n, k in kinds.items() if n.endswith(("o_proj", "down_proj"))} <= {"hadamard", "kron"}
    emb = model.model.embed_tokens
    assert isinstance(emb, QuantizedEmbedding) and (emb.head is not None) == rr.tied(model)
    assert rr.of(model)["seed"] == residual_seed(0)


def _kl(a, b):
    la, lb = a - mx.logsumexp(a, -1, keepdims=True), b - mx.logsumexp(b, -1, keepdims=True)
    return float(mx.mean(mx.sum(mx.exp(la) * (la - lb), -1)).item())


def test_quantized_model_tracks_the_source(source):
    """Both quantizations are the same kind of approximation of the source: KL of the same order (on
    random synthetic weights this says the plumbing is right, not which is better: docs/decode.md)."""
    x = mx.array(PROMPT)[None]
    ref = _load(source)(x)
    plain, res = _kl(ref, _quantized(source, False)(x)), _kl(ref, _quantized(source, True)(x))
    assert 0 < res < 2 * plain and res < 0.5


@pytest.mark.parametrize("persist", [True, False])
def test_reservoir_round_trip_is_byte_exact(source, persist, tmp_path):
    model = _quantized(source, True)
    path = tmp_path / "m.vqres"
    header = R.save_reservoir(model, path, persist_rotation=persist)
    assert header["residual_rotation"] == rr.of(model)
    trellis = any(getattr(m, "codes", "scalar") == "trellis" for m in model.modules())
    assert header["format_version"] == (5 if trellis else 4 if rr.tied(model) else R._version_for({}))
    back = R.load_reservoir(path)
    assert rr.of(back) == rr.of(model)
    from vqpipe.stages import show

    header, summary = show.summary(path)
    assert summary["residual_rotation"] == rr.of(model) and "folded into the weights" in show.render(header, summary)
    x = mx.array(PROMPT)[None]
    assert np.array(back(x)).tobytes() == np.array(model(x)).tobytes()
    if rr.tied(model):
        head = back.model.embed_tokens.head
        assert mx.array_equal(head.gain, model.model.embed_tokens.head.gain).item()


def test_fewer_primitives_per_decode_step(source):
    """q|k|v and gate|up rotate nothing per token: two rotations fewer per layer; the lookup rotates
    nothing either, and a tied head adds its input map (two rotations and a multiply)."""
    counts = []
    for residual in (False, True):
        model = _quantized(source, residual)
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(PROMPT)[None], cache=cache))
        counts.append(graph_ops(model(mx.array([[5]]), cache=cache))["ops"])
    layers = len(model.model.layers)
    assert counts[0] - counts[1] >= 2 * layers + (-1 if rr.tied(model) else 4), counts


def test_compiled_steps_give_the_eager_tokens(tiny_llama_source, tiny_source):
    for src in (tiny_llama_source, tiny_source):
        model = _quantized(src, True, 4)
        prompt = mx.array(PROMPT)
        want = Decoder(model, 40, "eager").generate(prompt, 8, prefill_step=8)["ids"]
        for mode in ("whole", "split"):
            assert Decoder(model, 40, mode).generate(prompt, 8, prefill_step=8)["ids"] == want, mode


def test_calibrated_quantize_reads_the_head_through_its_map(tiny_source):
    """GPTQ on the tied head sees what the head reads: Head(y) of the final norm's outputs."""
    from vqpipe.quant import calibrate

    model = _load(tiny_source)
    tokens = mx.array(np.arange(4 * 32).reshape(4, 32) % 1000 + 3, mx.int32)
    quantize_model(model, QuantizeConfig(3, dtype=mx.float32, residual=True, threads=1), calibration=tokens)
    emb = model.model.embed_tokens
    assert isinstance(emb, QuantizedEmbedding) and emb.head is not None
    ys = [mx.random.normal((2, 5, emb.in_features), key=mx.random.key(1))]
    assert mx.allclose(calibrate.head_inputs(model, ys)[0], emb.head(ys[0])).item()
    assert float(mx.max(mx.abs(model(mx.array(PROMPT)[None]))).item()) > 0


@pytest.mark.skipif(not _has_text(), reason="the calibration text (scripts/setup.sh installs it) is not on this machine")
def test_stages_pass_the_rotation_on(tiny_source, tmp_path):
    """calibrate --residual-rotation (with the plain model's moments too), quantize --moments with and
    without --residual-rotation from that one artifact, pack, load: recorded at every step; moments
    of another rotation are refused, naming it."""
    from vqpipe.stages import calibrate, pack, quantize
    from vqpipe.store import calibration
    from vqpipe.store.quantized import load_quantized

    quiet = {"progress": lambda *_: None}
    untuned = {**quiet, "tune_steps": 0}  # tuning through the head map: test_tune
    calibrate.run(tiny_source, tmp_path / "mom", windows=2, length=64, residual="auto", rotation_seed=5, plain=True,
                  **quiet)
    calibrate.run(tiny_source, tmp_path / "only", windows=2, length=64, residual="auto", rotation_seed=5, **quiet)
    info = quantize.run(tiny_source, tmp_path / "q", 4, seed=5, moments=tmp_path / "mom", residual=True, **untuned)
    spec = info["residual_rotation"]
    assert spec == {"kind": "hadamard", "dim": 256, "seed": residual_seed(5)}
    sets = json.loads((tmp_path / "mom" / "moments.json").read_text())["sets"]
    assert [m["residual_rotation"] for m in sets] == [None, spec]
    assert [m["residual_rotation"] for m in calibration.sets(json.loads((tmp_path / "only" / "moments.json").read_text()))] == [spec]
    plain = quantize.run(tiny_source, tmp_path / "p", 4, seed=5, moments=tmp_path / "mom", **untuned)
    assert plain["residual_rotation"] is None and plain["calibration"]["moments"] == str(tmp_path / "mom")
    with pytest.raises(ValueError, match=r"no moments collected with residual rotation None \(it holds \[\{"):
        quantize.run(tiny_source, tmp_path / "q2", 4, seed=5, moments=tmp_path / "only", **untuned)
    with pytest.raises(ValueError, match="no moments collected with residual rotation"):
        quantize.run(tiny_source, tmp_path / "q3", 4, seed=6, moments=tmp_path / "mom", residual=True, **untuned)
    pack.run(tmp_path / "q", tmp_path / "r", False, **quiet)
    assert R.read_header(tmp_path / "r" / R.FILE_NAME)["residual_rotation"] == spec
    model, _ = load_quantized(tmp_path / "q")
    back = R.load_reservoir(tmp_path / "r")
    assert rr.of(model) == rr.of(back) == spec
    x = mx.array(PROMPT)[None]
    assert np.array(back(x)).tobytes() == np.array(model(x)).tobytes()


def test_bad_requests_name_the_problem(tiny_source, tiny_llama_source, tmp_path):
    with pytest.raises(ValueError, match="rotation auto, hadamard or kron, not 'none'"):
        quantize_model(_load(tiny_source), QuantizeConfig(rotation="none", residual=True, calib_text="none"))
    with pytest.raises(ValueError, match="tied head needs its embedding quantized"):
        quantize_model(_load(tiny_source), QuantizeConfig(embeddings=False, residual=True, calib_text="none"))
    model = _load(tiny_llama_source)
    model.model.layers[1].input_layernorm = nn.LayerNorm(512)
    with pytest.raises(ValueError, match="block 1's input_layernorm is LayerNorm"):
        rr.rotate_residual(model, 0)
    assert rr.of(model) is None and isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)


def test_graft_refuses_another_stream_basis(tiny_source, tmp_path):
    path = tmp_path / "m.vqres"
    R.save_reservoir(_quantized(tiny_source, True), path)
    with pytest.raises(R.ReservoirError, match="residual rotation"):
        R.graft_reservoir(_load(tiny_source), path)
    plain = tmp_path / "p.vqres"
    R.save_reservoir(_quantized(tiny_source, False), plain)
    with pytest.raises(R.ReservoirError, match="residual rotation"):
        R.graft_reservoir(R.load_reservoir(path), plain)


def test_head_state_checked_in_the_header(tiny_source, tmp_path):
    from experiments import fuzz_reservoir as F

    path = tmp_path / "m.vqres"
    R.save_reservoir(_quantized(tiny_source, True), path)
    header = R.read_header(path)
    data = path.read_bytes()[header["_data_offset"]:]
    name = "model.embed_tokens"
    for edit, message in ((lambda h: h["layers"][name]["head"]["rotation"].update(kind="qr"), "head rotation"),
                          (lambda h: h["layers"][name]["head"].update(extra=1), "'head'"),
                          (lambda h: h["layers"][name]["tensors"].pop("head.gain"), "tensors"),
                          (lambda h: h.update(format_version=3), "head in a version 3 file"),
                          (lambda h: h.update(residual_rotation={"kind": "qr", "dim": 256, "seed": 1}), "residual_rotation")):
        h = json.loads(json.dumps({k: v for k, v in header.items() if not k.startswith("_")}))
        edit(h)
        bad = tmp_path / "bad.vqres"
        bad.write_bytes(F.assemble(h, data))
        with pytest.raises(R.ReservoirError, match=message):
            R.load_reservoir(bad)


def test_dense_copy_keeps_the_tied_head_map(tiny_source):
    from vqpipe.stages.bench_quality import dense_copy

    model = _load(tiny_source)
    quantize_model(model, QuantizeConfig(dtype=mx.float32, residual=True, threads=1, calib_text="none"))
    x = mx.array(PROMPT)[None]
    want = model(x)
    got = dense_copy(model)(x)
    assert isinstance(model.model.embed_tokens, rr.TiedEmbedding)
    assert float(mx.max(mx.abs(got - want)).item()) < max(1e-4, RTOL) * float(mx.max(mx.abs(want)).item())
