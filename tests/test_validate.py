"""The validate stage: bit-exact comparison, refusal across setups, verdict file, exit codes.

The reservoir loader (``vqpipe.load``) is replaced by ``quantized.load_quantized`` here, so these
tests pin the comparison logic whatever the reservoir format; tests/test_workflow.py runs the real
pack -> validate round trip through Snakemake.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

import vqpipe
from vqpipe.stages import quantize, validate
from vqpipe.store import quantized


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory, tiny_source):
    out = tmp_path_factory.mktemp("validate") / "b4-auto"
    quantize.run(tiny_source, out, bits=4, rotation="auto", seed=0, progress=lambda *_: None)
    return out


@pytest.fixture
def artifact(tmp_path, quantized_dir, monkeypatch):
    """(reservoir-like dir, reference dir): private copies of the quantized artifact."""
    monkeypatch.setattr(vqpipe, "load", quantized.load_quantized)
    ref = tmp_path / "quantized" / "tiny" / "b4-auto"
    shutil.copytree(quantized_dir, ref)
    res = tmp_path / "reservoir" / "tiny" / "b4-auto" / "persist-on"
    shutil.copytree(quantized_dir, res)
    for d in (ref, res):  # these tests edit the copies on purpose: no manifest to trip over
        (d / "manifest.json").unlink()
    return res, ref


def run_cli(res, ref, out, *extra):
    return validate.main(["--reservoir", str(res), "--reference", str(ref), "--out", str(out), *extra])


def rewrite_reference(ref, change):
    """Apply ``change(dict of numpy arrays)`` to reference.safetensors."""
    arrays = {k: np.array(v) for k, v in mx.load(str(ref / "reference.safetensors")).items()}
    change(arrays)
    mx.save_safetensors(str(ref / "reference.safetensors"), {k: mx.array(v) for k, v in arrays.items()})


def test_bit_exact_round_trip_passes(artifact, tmp_path):
    res, ref = artifact
    out = tmp_path / "verdict.json"
    assert run_cli(res, ref, out) == validate.EXIT_OK
    v = json.loads(out.read_text())
    assert v["bit_exact"] is True
    assert v["max_abs_diff"] == 0.0
    assert v["n_prompts"] == len(quantized.REFERENCE_PROMPTS) == len(v["prompts"])
    assert (v["model"], v["variant"], v["persist_rotation"]) == ("tiny", "b4-auto", "on")  # from the path
    assert v["kind"] == "validate"
    assert v["environment"]["blas"]["name"] == v["reference_environment"]["blas"]["name"]
    assert "bit-exact" in v["reason"]


def test_labels_from_arguments(artifact, tmp_path):
    res, ref = artifact
    out = tmp_path / "verdict.json"
    assert run_cli(res, ref, out, "--model", "m", "--variant", "b4-x", "--persist-rotation", "off") == 0
    v = json.loads(out.read_text())
    assert (v["model"], v["variant"], v["persist_rotation"]) == ("m", "b4-x", "off")


def test_one_ulp_difference_fails(artifact, tmp_path, capsys):
    res, ref = artifact

    def nudge(arrays):
        x = arrays["logits.2"]
        flat = x.reshape(-1)
        flat[7] = np.nextafter(flat[7], np.float32(np.inf), dtype=np.float32)

    rewrite_reference(ref, nudge)
    out = tmp_path / "verdict.json"
    assert run_cli(res, ref, out) == validate.EXIT_MISMATCH
    v = json.loads(out.read_text())
    assert v["bit_exact"] is False
    assert 0 < v["max_abs_diff"] < 1e-3
    assert [p["bit_exact"] for p in v["prompts"]] == [True, True, False, True]
    assert "prompt 2" in v["reason"]
    assert "not bit-exact" in capsys.readouterr().err


def test_other_tokens_fail(artifact, tmp_path):
    res, ref = artifact

    def retokenize(arrays):
        arrays["tokens.1"] = arrays["tokens.1"][::-1].copy()

    rewrite_reference(ref, retokenize)
    out = tmp_path / "verdict.json"
    assert run_cli(res, ref, out) == validate.EXIT_MISMATCH
    v = json.loads(out.read_text())
    assert v["prompts"][1]["tokens_match"] is False
    assert v["max_abs_diff"] is None
    assert "tokenizer" in v["reason"]


@pytest.mark.parametrize(
    "key, value, named",
    [
        (("blas", "name"), "some-other-blas", "blas.name"),
        (("backend",), "gpu", "backend"),
        (("device",), "Device(gpu, 0)", "device"),
        (("versions", "mlx"), "0.0.1", "versions.mlx"),
    ],
)
def test_refuses_other_setup(artifact, tmp_path, capsys, key, value, named):
    res, ref = artifact
    meta = json.loads((ref / "reference.json").read_text())
    node = meta["environment"]
    for k in key[:-1]:
        node = node[k]
    node[key[-1]] = value
    (ref / "reference.json").write_text(json.dumps(meta))
    out = tmp_path / "verdict.json"
    assert run_cli(res, ref, out) == validate.EXIT_REFUSED
    v = json.loads(out.read_text())
    assert v["bit_exact"] is None
    assert v["reason"].startswith("refusing to compare")
    assert named in v["reason"] and value in v["reason"]
    assert "refusing" in capsys.readouterr().err
    assert "load_seconds" not in v  # it did not even load the reservoir


def test_missing_inputs_are_usage_errors(tmp_path, quantized_dir):
    assert run_cli(tmp_path / "nope", quantized_dir, tmp_path / "v.json") == validate.EXIT_USAGE
    assert run_cli(quantized_dir, tmp_path, tmp_path / "v.json") == validate.EXIT_USAGE
    assert not (tmp_path / "v.json").exists()


def test_compare_arrays():
    a = np.array([1.0, 2.0, np.nan], dtype=np.float32)
    assert validate.compare_arrays(a, a.copy()) == (True, 0.0)
    b = a.copy()
    b[0] = 1.5
    assert validate.compare_arrays(b, a) == (False, 0.5)
    assert validate.compare_arrays(a[:2], a)[0] is False
    assert validate.compare_arrays(a.astype(np.float64), a)[0] is False  # same values, other bytes
    z = np.array([0.0, 1.0], dtype=np.float32)
    nz = np.array([-0.0, 1.0], dtype=np.float32)
    assert validate.compare_arrays(nz, z) == (False, 0.0)  # -0.0 == 0.0, but other bytes
    c = a.copy()
    c[1] = np.nan
    exact, diff = validate.compare_arrays(c, a)
    assert not exact and diff != diff  # NaN where only one side is NaN


def test_setup_differences():
    env = {"backend": "cpu", "device": "Device(cpu, 0)", "blas": {"name": "openblas", "threads": 2},
           "versions": {"mlx": "0.32.4"}, "cpu_model": "x"}
    same = json.loads(json.dumps(env))
    same["cpu_model"] = "y"
    assert validate.setup_differences(env, same) == []
    threads = json.loads(json.dumps(env))
    threads["blas"]["threads"] = 1  # some GEMM shapes round differently with 1 and 2 threads
    assert validate.setup_differences(env, threads) == ["blas.threads: 2 (reference) != 1 (here)"]
    other = json.loads(json.dumps(env))
    other["blas"]["name"] = "reference"
    (d,) = validate.setup_differences(env, other)
    assert d.startswith("blas.name") and "'openblas' (reference)" in d and "'reference' (here)" in d
    assert validate.setup_differences({}, env)  # a reference without an environment record is refused


@pytest.fixture(scope="module")
def grouped_dir(tmp_path_factory, tiny_source):
    """Group scales (the dense path multiplies them into the weight: dequant.scaled_values)."""
    out = tmp_path_factory.mktemp("validate") / "b4-auto-g64"
    quantize.run(tiny_source, out, bits=4, rotation="auto", seed=0, group_size=64, progress=lambda *_: None)
    return out


def own_forwards(model, tok):
    """The reference logits as separate forwards, one prompt at a time, nothing shared."""
    out = []
    for t in quantized.reference_tokens(tok):
        y = model(t[None]).astype(mx.float32)
        mx.eval(y)
        out.append(np.asarray(y[0]).tobytes())
    return out


@pytest.mark.parametrize("which", ["quantized_dir", "grouped_dir"])
def test_decoded_once_gives_the_same_logits_and_decodes_each_layer_once(which, request, monkeypatch):
    """reference_logits builds the prompts' forwards together, each weight decoded once for all of
    them (dequant.decoded_once), and computes them a block at a time: the bytes of each prompt's
    own forward, and the model's blocks are its own again afterwards."""
    from vqpipe.kernels import dequant

    model, tok = quantized.load_quantized(request.getfixturevalue(which))
    blocks = list(model.model.layers)
    want = own_forwards(model, tok)
    calls = []
    decode, decode_trellis = dequant.codes_to_values, dequant.trellis_values
    monkeypatch.setattr(dequant, "codes_to_values", lambda p, *a: calls.append(id(p)) or decode(p, *a))
    monkeypatch.setattr(dequant, "trellis_values", lambda p, *a, **k: calls.append(id(p)) or decode_trellis(p, *a, **k))
    got = quantized.reference_logits(model, tok)
    assert [np.asarray(got[f"logits.{i}"]).tobytes() for i in range(len(want))] == want
    assert dequant.codes_to_values is not decode and calls  # the patch is restored to what was there
    assert dequant.trellis_values is not decode_trellis
    assert dequant.scaled_values.__name__ == "scaled_values"  # and decoded_once's own
    assert all(a is b for a, b in zip(model.model.layers, blocks)) and len(model.model.layers) == len(blocks)
    n = len(quantized.REFERENCE_PROMPTS)
    layers = len([m for _, m in model.named_modules() if isinstance(m, vqpipe.layers.qlinear.QuantizedLinear)])
    # every weight decoded on the first prompt only; later prompts decode just their embedding rows
    assert len(calls) < layers + n and len(set(calls)) == len(calls)
    assert want == own_forwards(model, tok)  # nothing of the shared decoding is left behind


def test_a_changed_code_fails_every_prompt(artifact, tmp_path, monkeypatch):
    """Reusing decoded weights across prompts hides nothing: a reservoir with one code changed
    differs on every prompt, not only the first."""
    res, ref = artifact

    def load_changed(path):
        model, tok = quantized.load_quantized(path)
        layer = model.model.layers[0].mlp.down_proj
        layer.packed = layer.packed ^ mx.array(1, dtype=layer.packed.dtype)
        return model, tok

    monkeypatch.setattr(vqpipe, "load", load_changed)
    out = tmp_path / "verdict.json"
    assert run_cli(res, ref, out) == validate.EXIT_MISMATCH
    assert [p["bit_exact"] for p in json.loads(out.read_text())["prompts"]] == [False] * len(quantized.REFERENCE_PROMPTS)
