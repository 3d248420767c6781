"""The pack stage CLI, ``vqpipe.load`` + generate on a packed synthetic model, and ``inspect``."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import vqpipe
from vqpipe.stages import show as vinspect
from vqpipe.stages import pack, quantize
from vqpipe.store import quantized as quantized_artifact
from vqpipe.store import reservoir as R


@pytest.fixture(scope="module")
def quantized(tiny_llama_source, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized") / "b4-qr"
    # Dense QR rotations (512 and 1472 wide: a 4864-wide QR takes ~10 s per layer here), an untied
    # quantized lm_head: the case persist_rotation exists for.
    quantize.run(tiny_llama_source, out, bits=4, rotation="qr", progress=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def packed(quantized, tmp_path_factory):
    root = tmp_path_factory.mktemp("reservoir")
    out = {}
    for mode in ("on", "off"):
        assert pack.main(["--quantized", str(quantized), "--out", str(root / f"persist-{mode}"),
                          "--persist-rotation", mode]) == 0
        out[mode] = root / f"persist-{mode}"
    return out


@pytest.mark.parametrize("mode", ["on", "off"])
def test_pack_output_layout(packed, quantized, mode):
    d = packed[mode]
    names = {p.name for p in d.iterdir()}
    assert {"model.vqres", "config.json", "tokenizer.json", "pack.json"} <= names
    assert not names & {"quantized.json", "quantized.safetensors", "reference.json", "reference.safetensors"}
    info = json.loads((d / "pack.json").read_text())
    assert info["persist_rotation"] is (mode == "on")
    assert info["file_bytes"] == (d / "model.vqres").stat().st_size
    assert info["n_layers"] == len(json.loads((quantized / "quantized.json").read_text())["layers"])
    assert (d / "model.vqres").stat().st_mode & 0o044  # readable by others, not mkstemp's 0600


def test_persist_off_is_smaller_for_qr(packed):
    on = json.loads((packed["on"] / "pack.json").read_text())
    off = json.loads((packed["off"] / "pack.json").read_text())
    assert off["blob_bytes"]["rotation"] == 0 < on["blob_bytes"]["rotation"]
    assert off["file_bytes"] < on["file_bytes"]
    assert off["file_over_ideal"] < 1.1 < on["file_over_ideal"]


@pytest.mark.parametrize("mode", ["on", "off"])
def test_load_reproduces_reference_logits(packed, quantized, mode):
    model, tokenizer = vqpipe.load(packed[mode])
    got = quantized_artifact.reference_logits(model, tokenizer)
    ref = mx.load(str(quantized / "reference.safetensors"))
    assert set(got) == set(ref)
    for k in ref:
        assert np.array(got[k]).tobytes() == np.array(ref[k]).tobytes(), k


def test_load_and_generate(packed, quantized):
    from mlx_lm import generate

    model, tokenizer = vqpipe.load(packed["off"])
    text = generate(model, tokenizer, "The quick brown fox", max_tokens=12, verbose=False)
    want_model, want_tok = quantized_artifact.load_quantized(quantized)
    assert isinstance(text, str) and text
    assert text == generate(want_model, want_tok, "The quick brown fox", max_tokens=12, verbose=False)


def test_load_accepts_file_path(packed):
    model, tokenizer = vqpipe.load(packed["on"] / "model.vqres")
    assert tokenizer.encode("hello")


@pytest.mark.parametrize("args,message", [
    (["--persist-rotation", "maybe"], "must be on or off"),
    (["--persist-rotation", "on", "--quantized", "/nonexistent"], "not a quantize artifact"),
])
def test_cli_errors(tmp_path, capsys, quantized, args, message):
    argv = ["--quantized", str(quantized), "--out", str(tmp_path / "r")] + args
    assert pack.main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_pack_is_deterministic(quantized, packed, tmp_path):
    pack.main(["--quantized", str(quantized), "--out", str(tmp_path / "again"), "--persist-rotation", "off"])
    assert (tmp_path / "again" / "model.vqres").read_bytes() == (packed["off"] / "model.vqres").read_bytes()


# --- inspect ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["on", "off"])
def test_inspect_summary(packed, capsys, mode):
    assert vinspect.main([str(packed[mode])]) == 0
    out = capsys.readouterr().out
    header = R.read_header(packed[mode] / "model.vqres")
    n = len(header["layers"])
    assert f"{n} quantized" in out
    assert f"4 x{n}" in out  # bits
    assert ("qr (stored)" if mode == "on" else "qr (seed only)") in out
    assert f"persist_rotation  {mode}" in out
    assert f"all {len(header['blobs'])} blobs OK" in out
    assert "file / ideal = " in out and "MiB" in out


def test_inspect_layers_and_json(packed, capsys):
    assert vinspect.main([str(packed["on"] / "model.vqres"), "--layers"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.down_proj" in out and "1472" in out and "lm_head" in out
    assert vinspect.main([str(packed["on"]), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["persist_rotation"] is True and s["checksums"]["failed"] == []
    assert s["file_bytes"] == (packed["on"] / "model.vqres").stat().st_size


def test_inspect_reports_corruption(packed, tmp_path, capsys):
    header = R.read_header(packed["on"] / "model.vqres")
    blob = next(i for i, b in enumerate(header["blobs"]) if b["kind"] == "packed")
    data = bytearray((packed["on"] / "model.vqres").read_bytes())
    data[header["_data_offset"] + header["blobs"][blob]["offset"] + 5] ^= 0xFF
    bad = tmp_path / "bad.vqres"
    bad.write_bytes(bytes(data))
    assert vinspect.main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert "FAILED: 1 of" in out and f"blob {blob} (packed)" in out
    bad.write_bytes(b"not a reservoir at all, definitely longer than sixty-four bytes..............")
    assert vinspect.main([str(bad)]) == 1
    assert "not a vqpipe reservoir" in capsys.readouterr().err


def test_inspect_cli_subprocess(packed):
    proc = subprocess.run([sys.executable, "-m", "vqpipe", "inspect", str(packed["off"])],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "checksums   all" in proc.stdout


# --- bench-load ------------------------------------------------------------------------------


def test_bench_load_smoke(tiny_llama_source, tmp_path):
    """The load benchmark end to end on a tiny model: schema, byte-identical loads, sizes."""
    from vqpipe.stages import bench_load as bench

    out = tmp_path / "load.json"
    assert bench.main(["--source", str(tiny_llama_source), "--out", str(out), "--rotations", "auto",
                       "--repeats", "1", "--procs", "2", "--model", "tiny-llama"]) == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "bench-load" and doc["model"] == "tiny-llama"
    assert doc["environment"]["backend"] in ("cpu", "gpu")
    arms = {r["arm"] for r in doc["records"]}
    assert arms == {"requantize-auto", "reservoir-on-auto", "reservoir-off-auto", "reservoir-on-auto (no prefault)"}
    for r in doc["records"]:
        assert {"n", "median", "min", "max"} <= r.keys() and r["n"] >= 1
    assert all(doc["checks"].values()) and doc["multiprocess"]["logits_byte_identical"]
    assert doc["sizes"]["b4-auto"]["on"]["file_over_ideal"] < 1.1
    assert {c["method"] for c in doc["copy_paths"]} >= {"vqpipe", "vqpipe-noprefault", "mmap-xxh3", "read-2copies",
                                                        "mx.load", "fresh-memory-prefault"}
    t = doc["throughput"]["reservoir-on-auto"]
    assert t["cat_seconds"]["n"] == 1 and 0 < t["load_over_cat"]
    assert doc["bounds"]["max_speedup_at_fresh_memory_floor"] > 0 and "prefault" in doc["memory_setup"]
    mp = doc["multiprocess"]
    assert mp["reservoir_load"]["Rss"]["n"] == 2 and mp["reservoir_load"]["Pss"]["median"] > 0
    assert {c["other_arm"] for c in doc["comparisons"]} == {"reservoir-on-auto", "reservoir-off-auto"}


def test_load_warns_when_the_reference_setup_differs(packed, tmp_path):
    import shutil
    import warnings

    info = json.loads((packed["off"] / "pack.json").read_text())
    assert info["reference_setup"]["blas"]["name"]  # the setup the reference logits were made under
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vqpipe.load(packed["off"])  # same process setup as quantize: no warning
    other = tmp_path / "other"
    shutil.copytree(packed["off"], other)
    info["reference_setup"]["blas"]["name"] = "some-other-blas"
    (other / "pack.json").write_text(json.dumps(info))
    with pytest.warns(UserWarning, match="blas.name: 'some-other-blas' \\(artifact\\)"):
        vqpipe.load(other)
    # Another thread count or MLX version: nothing a user of the model can act on, no warning.
    info["reference_setup"]["blas"]["name"] = json.loads((packed["off"] / "pack.json").read_text())[
        "reference_setup"]["blas"]["name"]
    info["reference_setup"]["blas"]["threads"] = 97
    info["reference_setup"]["versions"]["mlx"] = "0.0.1"
    (other / "pack.json").write_text(json.dumps(info))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vqpipe.load(other)
