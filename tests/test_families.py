"""Each model family a user brings (docs/models.md, "Families"), end to end on its small synthetic
preset: download -> calibrate -> quantize (the automatic recipe: moments, sensitivities,
allocation) -> pack (persist_rotation on and off) -> validate bit-exact -> vqpipe.load -> greedy
tokens equal to the in-memory quantized model's; and what each family is refused, in one line."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_unflatten

import vqpipe
from vqpipe.sources import synth
from vqpipe.stages import calibrate, pack, quantize, validate
from vqpipe.stages.download import fetch

# preset -> (mlx-lm module of its blocks, split compiled decode refusal or None, packed KIVI refusal or None)
FAMILIES = {
    "tiny": ("qwen2", None, None),
    "tiny-llama": ("llama", None, None),
    "tiny-qwen3": ("qwen3", None, None),
    "tiny-mistral": ("llama", None, None),  # model_type mistral runs mlx-lm's llama model
    "tiny-phi3": ("phi3", "blocks are mlx_lm.models.phi3", None),
    "tiny-gemma2": ("gemma2", "blocks are mlx_lm.models.gemma2", "mlx_lm.models.gemma2 computes attention itself"),
    "tiny-gemma3": ("gemma3_text", "RotatingKVCache", None),
}
# qwen2's preset, tiny, has a 4864-wide MLP: its calibrated GPTQ and allocation take ~5x the others'
# time, so it runs with the slow tests (calibrated quantize of tiny: tests/test_quantize.py,
# test_tied_head.py; its reservoir round trip: tests/test_workflow.py)
PARAMS = [pytest.param(p, marks=pytest.mark.slow) if p == "tiny" else p for p in FAMILIES]
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
NEW_TOKENS = 8


def quiet(*_):
    pass


def greedy(model, tokenizer, n=NEW_TOKENS, cache=None):
    from mlx_lm.generate import generate_step

    prompt = mx.array(tokenizer.encode(PROMPT))
    steps = generate_step(prompt, model, max_tokens=n, prompt_cache=cache)
    return [int(t) for t, _ in steps]


@pytest.fixture(scope="module", params=PARAMS)
def built(request, tmp_path_factory, monkeypatch_module):
    """(preset, source dir, quantize dir, {persist: reservoir dir}, in-memory quantized model's tokens)."""
    preset = request.param
    root = tmp_path_factory.mktemp(preset)
    source = fetch(f"synth:{preset}", root / "source")
    # the automatic recipe from a calibrate artifact, as the pipeline runs it (a few short windows)
    calibrate.run(source, root / "moments", windows=4, length=48, progress=quiet)
    made = {}
    save = quantize.save_quantized

    def keep(model, tokenizer, *args):  # the in-memory quantized model, before it is saved
        made["tokens"] = greedy(model, tokenizer)
        return save(model, tokenizer, *args)

    monkeypatch_module.setattr(quantize, "save_quantized", keep)
    info = quantize.run(source, root / "q", bits=3, moments=root / "moments", progress=quiet)
    monkeypatch_module.undo()
    assert info["allocation"]["automatic"] and info["calibration"]["moments"]
    reservoirs = {}
    for persist in (True, False):
        reservoirs[persist] = root / f"persist-{'on' if persist else 'off'}"
        pack.run(root / "q", reservoirs[persist], persist, progress=quiet)
    return preset, source, root / "q", reservoirs, made["tokens"]


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_round_trip_bit_exact_and_same_greedy_tokens(built):
    preset, source, qdir, reservoirs, tokens = built
    config = json.loads((source / "config.json").read_text())
    assert config["model_type"] == synth.PRESETS[preset]["model_type"]
    records = json.loads((qdir / "quantized.json").read_text())["records"]
    assert all(r["calibrated"] for r in records if r["kind"] == "linear")  # every linear had its moments
    for persist, res in reservoirs.items():
        verdict = validate.run(res, qdir, progress=quiet)
        assert verdict["bit_exact"] is True, (persist, verdict["reason"])
        model, tokenizer = vqpipe.load(res)
        assert type(model.layers[0]).__module__ == f"mlx_lm.models.{FAMILIES[preset][0]}"
        assert greedy(model, tokenizer) == tokens, persist


def test_generate_command_and_decode_paths(built, capsys):
    from vqpipe.apps import generate
    from vqpipe.decode.step import Decoder, model_problem
    from vqpipe.kivi import make_kivi_cache

    preset, _, _, reservoirs, tokens = built
    _, split_refusal, kivi_refusal = FAMILIES[preset]
    res = reservoirs[False]
    assert generate.main(["--model", str(res), "--prompt", "Hello", "--max-tokens", "4", "--compiled", "off"]) == 0
    assert "Generation: " in capsys.readouterr().out
    model, tokenizer = vqpipe.load(res)
    prompt = mx.array(tokenizer.encode(PROMPT))
    for mode in ("whole", "split"):
        refusal = split_refusal if mode == "split" or split_refusal == "RotatingKVCache" else None
        if refusal is None:
            assert model_problem(model, mode) is None
            assert list(Decoder(model, 64, mode).tokens(prompt, NEW_TOKENS)) == tokens, mode
        else:
            with pytest.raises(ValueError, match=refusal):
                Decoder(model, 64, mode)
            assert generate.main(["--model", str(res), "--prompt", "Hello", "--max-tokens", "2",
                                  "--compiled", mode]) == 2
            err = capsys.readouterr().err
            assert err.startswith("vqpipe generate: error: ") and refusal in err and err.count("\n") == 1
    if kivi_refusal is None:
        assert len(greedy(model, tokenizer, 4, make_kivi_cache(model, 4, 32, 128, packed=True))) == 4
    else:
        with pytest.raises(ValueError, match=kivi_refusal):
            make_kivi_cache(model, 4, 32, 128, packed=True)
        assert len(greedy(model, tokenizer, 4, make_kivi_cache(model, 4, 32, 128, packed=False))) == 4  # the reference cache


class _Inputs(nn.Module):
    """Records a linear's inputs in the model's own forward."""

    def __init__(self, inner, seen):
        super().__init__()
        self.inner, self._seen = inner, seen

    def __call__(self, x):
        self._seen.append(x)
        return self.inner(x)


def test_calibration_moments_are_the_models_own_block_inputs(built):
    """The moments calibration collects block by block equal those of each linear's inputs in the
    model's own forward: Gemma's embedding scale and sliding-window masks included."""
    from mlx_lm.utils import load

    from vqpipe.quant.calibrate import calibration_tokens, full_precision_moments

    _, source, _, _, _ = built
    model, tokenizer = load(str(source))
    model.set_dtype(mx.float32)
    tokens, _ = calibration_tokens(tokenizer, "text", 2, 40, 0)  # 40 tokens: past gemma3's window of 16
    names, sums = full_precision_moments(model, tokens)
    modules = dict(model.named_modules())
    linears = [n for n, m in modules.items() if isinstance(m, nn.Linear) and n.startswith("model.layers.")]
    seen = {n: [] for n in linears}
    model.update_modules(tree_unflatten([(n, _Inputs(modules[n], seen[n])) for n in linears]))
    model(tokens)
    for name in linears:
        x = np.concatenate([np.asarray(a.reshape(-1, a.shape[-1])) for a in seen[name]])
        want = x.T @ x
        got = np.asarray(sums[names[name]])
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), name


def test_untied_gemma3_loads_with_its_own_head(tmp_path):
    """mlx-lm's gemma3_text ties or not by the weights it gets, not by config.json: a reservoir of a
    checkpoint that stores lm_head.weight loads with that head, and generates as the quantized model did."""
    from vqpipe.quant.quantize import QuantizeConfig, quantize_model
    from vqpipe.store import manifest

    source = fetch("synth:tiny-gemma3", tmp_path / "source")
    weights = mx.load(str(source / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = (mx.random.normal(embed.shape, key=mx.random.key(3)) * 0.02).astype(embed.dtype)
    mx.save_safetensors(str(source / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    manifest.write(source)  # the download's checksums were of the tied files
    info = quantize.run(source, tmp_path / "q", bits=4, calibration="none", progress=quiet)
    assert "lm_head" in {r["name"] for r in info["records"]}
    pack.run(tmp_path / "q", tmp_path / "r", False, progress=quiet)
    assert validate.run(tmp_path / "r", tmp_path / "q", progress=quiet)["bit_exact"] is True
    model, tokenizer = vqpipe.load(tmp_path / "r")
    assert model.tie_word_embeddings is False and "lm_head" in model
    from mlx_lm.utils import load

    fresh, _ = load(str(source))
    quantize_model(fresh, QuantizeConfig(bits=4, calib_text="none"), progress=quiet)
    assert greedy(model, tokenizer) == greedy(fresh, tokenizer)


def test_unknown_family_is_one_clear_error():
    with pytest.raises(ValueError, match="model_type 'gpt2' are not built; known: qwen2, llama, qwen3"):
        synth.family("gpt2")
