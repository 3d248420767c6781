"""Mixed bit widths per layer (vqpipe/codec/allocate.py): rules, the greedy budget, the quantized model,
its bits and its reservoir round trip."""

import json

import mlx.core as mx
import numpy as np
import pytest

from vqpipe.codec import allocate
from vqpipe.store import reservoir as R
from vqpipe.codec.codebook import codebook
from vqpipe.layers.fused import fused_groups, unfuse_model
from vqpipe.layers.qlinear import QuantizedLinear
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import quantize_model
from vqpipe.stages import bench_quality as q

from test_reservoir import make_model
from test_tied_head import CALIB, TIED, TOKENS, assert_round_trip

NAMES = ["model.embed_tokens", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj",
         "model.layers.1.self_attn.v_proj", "model.layers.1.mlp.down_proj"]


def test_rules_resolve_to_widths_later_rule_wins():
    rules = [{"match": "v_proj", "add": 1}, {"match": r"layers\.1\.", "add": 2}, {"match": "embed", "bits": 8}]
    assert allocate.resolve(rules, NAMES, 4) == {
        "model.embed_tokens": 8, "model.layers.0.self_attn.v_proj": 5,
        "model.layers.1.self_attn.v_proj": 6, "model.layers.1.mlp.down_proj": 6}
    # the same rules at another base width: +1/+2 over it
    assert allocate.resolve(rules, NAMES, 3)["model.layers.0.self_attn.v_proj"] == 4
    assert allocate.resolve([], NAMES, 4) == {}


@pytest.mark.parametrize("rules,pattern", [
    ([{"match": "q_proj", "add": 1}], "matches no quantized layer"),
    ([{"match": "v_proj", "add": 3}], "gives 7 bits"),
    ([{"match": "v_proj", "bits": 1}], "gives 1 bits"),
    ([{"match": "v_proj"}], "must be"),
    ([{"match": "v_proj", "add": 1, "bits": 5}], "must be"),
    ([{"match": "v_proj", "add": 1.5}], "must be an integer"),
    ([{"match": "(", "add": 1}], "bad regular expression"),
    ({"v_proj": 1}, "must be a list"),
])
def test_bad_rules_are_named(rules, pattern):
    with pytest.raises(ValueError, match=pattern):
        allocate.resolve(rules, NAMES, 4)


def test_greedy_takes_the_best_gain_per_bit_within_the_budget():
    gains = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 0.5, "e": -1.0}
    costs = {"a": 3.0, "b": 0.5, "c": 4.0, "d": 1.0, "e": 1.0}
    # per bit: b 2.0, a 1.0, c 0.5, d 0.5; c no longer fits after b and a, d still does
    assert allocate.greedy(gains, costs, 5.0) == ["b", "a", "d"]
    assert allocate.greedy(gains, costs, 0.1) == []


def test_wider_codebooks_fit():
    for bits in (5, 6, 8):
        levels = codebook(bits, 64)
        assert len(levels) == 1 << bits and np.all(np.diff(levels) > 0)


RULES = [{"match": "v_proj", "add": 1}, {"match": "down_proj", "add": 2}, {"match": "embed_tokens", "bits": 8}]


@pytest.fixture(scope="module")
def mixed():
    model, config = make_model(TIED)
    settings = QuantizeConfig(3, seed=1, group_size=16, layer_bits=RULES, dtype="float32", threads=1, calib_text="none")
    records = quantize_model(model, settings, calibration=CALIB)
    return model, config, records


def test_mixed_model_has_the_widths_and_counts_their_bits(mixed):
    model, _, records = mixed
    width = {r["name"]: r["bits"] for r in records}
    assert width["model.embed_tokens"] == 8
    assert all(b == 4 for n, b in width.items() if n.endswith("v_proj"))
    assert all(b == 5 for n, b in width.items() if n.endswith("down_proj"))
    assert all(b == 3 for n, b in width.items() if n.endswith(("q_proj", "k_proj", "o_proj", "gate_proj")))
    # bench-quality's count: codes at each layer's width, + group scales, codebooks, rotations
    bpw = q.bits_per_weight(model)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    codes = sum(m.bits * m.out_features * -(-m.in_features // 32) * 32 for m in layers.values())
    weights = sum(m.out_features * m.in_features for m in layers.values())
    assert bpw["parts_bpw"]["packed"] == pytest.approx(codes / weights)
    assert bpw["bpw"] > 3 + 16 / 16


def test_mixed_widths_fuse_only_equal_siblings_and_match_unfused(mixed):
    model, _, _ = mixed
    groups = fused_groups(model)
    # q/k/v differ (v has 4 bits): not fused; gate/up (3 bits both) still are
    assert groups and all(g.bits == 3 and len(g.splits) == 1 for g in groups.values())
    want = np.array(model(TOKENS))
    unfuse_model(model)
    assert np.allclose(np.array(model(TOKENS)), want, atol=1e-5)
    from vqpipe.layers.fused import fuse_model

    fuse_model(model)


def test_mixed_reservoir_round_trip_is_bit_exact(mixed, tmp_path):
    model, config, _ = mixed
    assert_round_trip(model, config, tmp_path, format_version=3)  # widths beyond 2/3/4


def test_a_wide_layer_in_an_older_version_file_is_refused(mixed, tmp_path):
    from test_reservoir import expect_error, rewrite_header, variant

    model, config, _ = mixed
    path = tmp_path / R.FILE_NAME
    (tmp_path / "config.json").write_text(json.dumps(config))
    R.save_reservoir(model, path, persist_rotation=True)

    def older(data):
        from test_reservoir import reprefix

        out = rewrite_header(data, lambda h: h.update(format_version=2))
        return reprefix(out, version=2)

    expect_error(variant(tmp_path, path, "v2.vqres", older), "bits in a version 2 file")


def test_uniform_widths_still_write_the_old_versions(tmp_path):
    model, config = make_model(TIED)
    settings = QuantizeConfig(seed=1, layer_bits=[{"match": "v_proj", "add": 0}], dtype="float32", threads=1,
                              calib_text="none", codes="scalar")
    quantize_model(model, settings)
    path = tmp_path / R.FILE_NAME
    (tmp_path / "config.json").write_text(json.dumps(config))
    R.save_reservoir(model, path, persist_rotation=True)
    assert R.read_header(path)["format_version"] == 1


def test_quantize_cli_rejects_bad_layer_bits(tmp_path, capsys):
    from vqpipe.stages import quantize as stage

    assert stage.main(["--source", str(tmp_path), "--out", str(tmp_path / "o"), "--layer-bits", "{v_proj"]) == 2
    assert "--layer-bits is not JSON" in capsys.readouterr().err


def test_widths_without_a_decode_kernel_run_dense(mixed, monkeypatch):
    """qmv covers 2/3/4/8 bits: where it would launch, 5- and 6-bit layers (and fused groups of
    them) take the dense path instead of failing in the kernel's argument check."""
    from vqpipe.kernels import qmv

    model, _, _ = mixed
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    wide = next(m for n, m in layers.items() if m.bits == 5)  # a down_proj at 3 + 2 bits
    narrow = next(m for n, m in layers.items() if m.bits == 3 and n.endswith("o_proj"))
    x = mx.random.normal((1, wide.in_features))
    want = np.array(wide(x))
    launched = []
    monkeypatch.setattr(qmv, "dispatch", lambda x: "cuda")
    monkeypatch.setattr(qmv, "launch", lambda *a, **k: launched.append(a[5]) or mx.zeros((1, a[2].shape[0])))
    assert np.array_equal(np.array(wide(x)), want) and launched == []
    narrow(mx.random.normal((1, narrow.in_features)))
    assert launched == [3]
