"""The automatic recipe: the bit allocation (vqpipe/quant/recipe.py) and its defaults everywhere."""

import inspect
from dataclasses import asdict, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import yaml
from mlx.utils import tree_flatten

from vqpipe import parallel
from vqpipe.quant import recipe
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import _targets, calibrate_model, layer_rotation, quantize_model
from vqpipe.quant.tune import steps_for
from vqpipe.stages import bench_quality
from vqpipe.quant.calibrate import auto_calibration
from vqpipe.stages import quantize as stage

from test_reservoir import make_model

TIED = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "tie_word_embeddings": True}
CALIB = mx.array(np.random.default_rng(5).integers(0, 256, (4, 32)), dtype=mx.int32)
ROOT = Path(__file__).resolve().parent.parent
# the settings these tests had as quantize_model's defaults before QuantizeConfig
BASE = QuantizeConfig(3, dtype="float32", threads=1, calib_text="none")


def random_tables(seed, n=40):
    rng = np.random.default_rng(seed)
    tables = {}
    for i in range(n):
        size = int(rng.integers(100, 5000))
        scale = float(rng.lognormal(0, 2))
        tables[f"layer{i:02d}"] = {w: (size * w + 64, scale * 2.0 ** (-2 * w)) for w in (3, 4, 5)}
    return tables


def test_allocate_within_budget_deterministic_monotone():
    tables = random_tables(0)
    base = sum(t[3][0] for t in tables.values())
    prev_err, prev_spent = None, None
    for extra in np.linspace(0, 2.2, 23):
        budget = base + extra * sum(t[3][0] - 64 for t in tables.values()) / 3
        choice, spent = recipe.allocate(tables, budget)
        assert spent <= budget
        assert spent == sum(tables[n][w][0] for n, w in choice.items())
        # the same whatever the order the layers come in
        shuffled = dict(reversed(list(tables.items())))
        assert recipe.allocate(shuffled, budget) == (choice, spent)
        err = sum(tables[n][w][1] for n, w in choice.items())
        if prev_err is not None:
            assert err <= prev_err and spent >= prev_spent
        prev_err, prev_spent = err, spent
    # everything fits: every layer at its widest
    choice, _ = recipe.allocate(tables, 10 * base)
    assert set(choice.values()) == {5}
    # nothing to spend: every layer at its base
    assert set(recipe.allocate(tables, base)[0].values()) == {3}


def test_allocate_prefers_gain_per_bit():
    tables = {"big": {4: (1000, 1.0), 5: (2000, 0.5)}, "small": {4: (100, 1.0), 5: (200, 0.5)}}
    choice, spent = recipe.allocate(tables, 1100 + 100)
    assert choice == {"big": 4, "small": 5} and spent == 1200


def test_check_budget():
    assert recipe.check_budget(None, 4) == 4.5 and recipe.check_budget("auto", 2) == 2.5
    assert recipe.check_budget("none", 3) is None and recipe.check_budget(3.25, 3) == 3.25
    for bad in ("4.5", 1.0, True, 20):
        with pytest.raises(ValueError, match="budget"):
            recipe.check_budget(bad, 3)


def test_fisher_deterministic_and_model_unchanged():
    model, _ = make_model(TIED)
    model.set_dtype(mx.bfloat16)
    before = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    dtypes = {k: v.dtype for k, v in tree_flatten(model.parameters())}
    names = recipe.sensitive_layers(model)
    a = recipe.output_fisher(model, CALIB, names)
    b = recipe.output_fisher(model, CALIB, names)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert "model.embed_tokens" in a and "model.embed_tokens" + recipe.LOOKUP in a  # tied: head and lookups
    assert a["model.embed_tokens"].shape == (model.args.vocab_size,)
    assert all(np.all(v >= 0) and np.all(np.isfinite(v)) for v in a.values())
    assert all(a[n].sum() > 0 for n in names if "v_proj" in n)
    after = tree_flatten(model.parameters())
    assert {k: v.dtype for k, v in after} == dtypes
    assert all(np.array_equal(before[k], np.array(v.astype(mx.float32))) for k, v in after)


def test_predictions_do_not_depend_on_the_token_count():
    """Every predicted loss is in one unit: calibrating on the same windows twice doubles the summed
    moments, and with them every layer's prediction, the tied table's lookups included (they were
    once a token's while the outputs' were N tokens')."""
    model, _ = make_model(TIED)
    targets = [(n, k) for n, _, k in _targets(model, True, True)]
    rot = lambda name, dim: layer_rotation("auto", 0, name, dim)  # noqa: E731
    once = calibrate_model(model, CALIB)
    twice = calibrate_model(model, mx.concatenate([CALIB, CALIB]))  # the Fisher reads the first 4 windows
    t1, t2 = (recipe.plan(model, 3, targets, m, f, 3.5, rot, codes=BASE.codes)[1] for m, f in (once, twice))
    emb = "model.embed_tokens"
    assert once[1][emb + recipe.LOOKUP] > 0 and np.allclose(twice[1][emb + recipe.LOOKUP], 2 * once[1][emb + recipe.LOOKUP])
    for name in t1:
        for w in t1[name]:
            assert t2[name][w][1] == pytest.approx(2 * t1[name][w][1], rel=1e-4), (name, w)


def test_calibrate_artifact_stores_the_lookup_in_the_same_unit(tiny_llama_source, tmp_path):
    """The calibrate stage stores a tied table's lookup term scaled by its windows x length (as
    calibrate_model computes it) and says so; an artifact from before, without the record, is
    scaled when read."""
    import json

    from vqpipe.stages import calibrate
    from vqpipe.store.calibration import load_fisher

    out = tmp_path / "moments"
    calibrate.run(tiny_llama_source, out, windows=4, length=32, progress=lambda *a: None)
    info = json.loads((out / "moments.json").read_text())
    assert info["sensitivity"]["lookup_tokens"] == 4 * 32
    new = load_fisher(out)
    lookups = [k for k in new if k.endswith(recipe.LOOKUP)]
    assert lookups and all(new[k] > 0 for k in lookups)
    del info["sensitivity"]["lookup_tokens"]  # as an artifact from before 2026-12-07 records it
    (out / "moments.json").write_text(json.dumps(info))
    old = load_fisher(out)
    assert all(np.allclose(old[k], new[k] * 128) for k in lookups)
    assert all(np.array_equal(old[k], new[k]) for k in new if k not in lookups)


def test_stored_bits_as_bench_quality_counts():
    model, _ = make_model(TIED)
    moments, fisher = calibrate_model(model, CALIB)
    targets = [(n, k) for n, _, k in _targets(model, True, True)]
    rot = lambda name, dim: layer_rotation("auto", 0, name, dim)  # noqa: E731
    # 64-wide rows: the float32 row scales alone cost 0.5 bits per weight, the trellis table 0.36 here
    choice, tables, weights = recipe.plan(model, 3, targets, moments, fisher, 4.6, rot, codes=BASE.codes)
    assert len(set(choice.values())) > 1  # a mixed allocation
    spent = sum(tables[n][w][0] for n, w in choice.items())
    model2, _ = make_model(TIED)
    quantize_model(model2, replace(BASE, fuse=False, budget=4.6), calibration=CALIB)
    total, counted = recipe.model_bits(model2)
    spent += recipe.TRELLIS_TABLE_BITS  # the default codes are trellis: the table, once per model
    assert counted == weights and total == spent and total <= 4.6 * weights
    assert bench_quality.bits_per_weight(model2)["bpw"] == pytest.approx(total / weights, rel=1e-12)
    got = {n: m.bits for n, m in model2.named_modules() if hasattr(m, "to_state")}
    assert got == choice


def test_budget_none_and_rules_override():
    model, _ = make_model(TIED)
    quantize_model(model, replace(BASE, budget="none", fuse=False), calibration=CALIB)
    assert {m.bits for _, m in model.named_modules() if hasattr(m, "to_state")} == {3}
    model, _ = make_model(TIED)
    quantize_model(model, replace(BASE, layer_bits=[{"match": "v_proj", "add": 1}], fuse=False), calibration=CALIB)
    widths = {n: m.bits for n, m in model.named_modules() if hasattr(m, "to_state")}
    assert all(w == (4 if "v_proj" in n else 3) for n, w in widths.items())


def test_budget_monotone_on_a_model():
    model, _ = make_model(TIED)
    moments, fisher = calibrate_model(model, CALIB)
    targets = [(n, k) for n, _, k in _targets(model, True, True)]
    rot = lambda name, dim: layer_rotation("auto", 0, name, dim)  # noqa: E731
    errs = []
    for budget in (3.9, 4.0, 4.2, 4.6, 5.0):
        choice, tables, weights = recipe.plan(model, 3, targets, moments, fisher, budget, rot)
        assert sum(tables[n][w][0] for n, w in choice.items()) <= budget * weights
        errs.append(sum(tables[n][w][1] for n, w in choice.items()))
    assert errs == sorted(errs, reverse=True) and errs[-1] < errs[0]


def test_config_defaults_are_the_clis():
    """QuantizeConfig() (quantize_model's default) is what the quantize CLI does with no option."""
    args = vars(stage.parser().parse_args(["--source", "s", "--out", "o"]))
    for data in ("source", "out", "moments"):  # data, not settings: quantize_model's keywords
        del args[data]
    # the CLI's names and spellings of the same settings
    args["calib_text"], args["residual"] = args.pop("calibration"), args.pop("residual_rotation")
    args["dtype"] = None if args["dtype"] == "source" else args["dtype"]
    args["threads"] = args["threads"] or parallel.default_threads()
    args["fuse"] = True  # the artifact's layers are always fused
    assert asdict(QuantizeConfig()) == args
    assert inspect.signature(quantize_model).parameters["config"].default is None


def test_defaults_agree():
    """quantize_model, the quantize CLI and the pipeline's config give the same recipe."""
    api = QuantizeConfig()
    cli = stage.parser().parse_args(["--source", "s", "--out", "o"])
    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    cal = schema["$defs"]["calibration"]["properties"]
    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    q = schema["properties"]["quantize"]["properties"]
    assert api.embeddings is True and cli.embeddings is True and q["embeddings"]["default"] is True
    assert config["quantize"]["embeddings"] is True
    assert api.sequential is False and cli.sequential is False and cal["sequential"]["default"] is False
    assert config["quantize"]["calibration"]["sequential"] is False
    assert cli.calibration == "auto" and cli.moments is None  # text, or none for a synth: source (stage.run)
    assert inspect.signature(stage.run).parameters["calibration"].default is None
    assert api.calib_text == cal["text"]["default"] == "auto"
    assert auto_calibration(Path("/nonexistent")) == "text" and config["quantize"]["calibration"]["text"] == "auto"
    assert api.calib_windows == cli.calib_windows == cal["windows"]["default"] == config["quantize"]["calibration"]["windows"]
    assert api.budget == cli.budget == q["budget"]["default"] == "auto"
    assert config["quantize"]["budget"] == "auto" and config["quantize"]["layer_bits"] == []
    assert api.group_size is None and cli.group_size is None and config["quantize"]["group_size"] is None
    tune = {"steps": api.tune_steps, "lr": api.tune_lr, "length": api.tune_length}
    assert tune == {"steps": cli.tune_steps, "lr": cli.tune_lr, "length": cli.tune_length}
    assert tune == q["tune"]["default"] == config["quantize"]["tune"] and api.tune_steps == "auto"
    assert [steps_for("auto", b) for b in (2, 3, 4)] == [64, 32, 0]
    # no model of the default config carries hand-made widths
    assert not any(m.get("quantize", {}).get("layer_bits") for m in config["models"].values())


def test_self_generated_calibration_deterministic(tiny_llama_source):
    from mlx_lm.utils import load

    from vqpipe.quant.calibrate import calibration_tokens

    model, tok = load(str(tiny_llama_source))
    dtypes = {k: v.dtype for k, v in tree_flatten(model.parameters())}
    a, info = calibration_tokens(tok, "self", 3, 40, seed=1, model=model)
    b, _ = calibration_tokens(tok, "self", 3, 40, seed=1, model=model)
    c, _ = calibration_tokens(tok, "self", 3, 40, seed=2, model=model)
    assert a.shape == (3, 40) and a.dtype == mx.int32
    assert np.array_equal(np.array(a), np.array(b)) and not np.array_equal(np.array(a), np.array(c))
    assert info["text"] == "self" and info["provenance"]["seeds"]
    assert {k: v.dtype for k, v in tree_flatten(model.parameters())} == dtypes  # the model as it was
    with pytest.raises(ValueError, match="needs the source model"):
        calibration_tokens(tok, "self", 3, 40)


def test_api_recipe_with_tokenizer(tiny_llama_source):
    """quantize_model(model, config, tokenizer=tok): the calibrate stage's moments and the allocation."""
    from mlx_lm.utils import load

    model, tok = load(str(tiny_llama_source))
    config = QuantizeConfig(calib_windows=4, calib_length=64, budget=6.0, fuse=False)  # the recipe's 64 x 512, smaller
    records = quantize_model(model, config, tokenizer=tok)
    assert all(r["calibrated"] for r in records if r["kind"] == "linear")
    total, weights = recipe.model_bits(model)
    assert total <= 6.0 * weights and len({r["bits"] for r in records}) > 1


def test_cli_auto_calibration_follows_the_source(tiny_source, tmp_path):
    """A synth: source stays data-free by default, as in the config (random weights)."""
    assert auto_calibration(tiny_source) == "none"
    info = stage.run(tiny_source, tmp_path / "q", 4, progress=lambda *_: None)
    assert info["calibration"] is None and not info["allocation"]["automatic"]
