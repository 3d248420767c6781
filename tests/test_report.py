import json
import re

import pytest

from vqpipe import report
from vqpipe.bench import compare, environment, noise_floor, summarize

# Sample lists shaped like real runs (seconds or tok/s), run through the real harness helpers.
LOAD_FULL = [0.412, 0.398, 0.405, 0.431, 0.401]
LOAD_FULL_AA = [0.409, 0.402, 0.399, 0.420, 0.404]
LOAD_RES = [0.051, 0.049, 0.050, 0.055, 0.050]


@pytest.fixture(scope="module")
def env():
    return environment()


def _rec(samples, **keys):
    return {**keys, **summarize(samples)}


def _artifacts(env):
    floor = noise_floor(LOAD_FULL, LOAD_FULL_AA)
    arts = {}
    arts["quantized/tiny/b4-hadamard/quantized.json"] = {
        "model": "tiny", "variant": "b4-hadamard", "bits": 4, "rotation": {"kind": "hadamard"},
        "quantized_bytes": 1_234_567, "source_bytes": 8_765_432, "environment": env,
    }
    for persist in (True, False):
        arts[f"validate/tiny/b4-hadamard/persist-{'on' if persist else 'off'}.json"] = {
            "kind": "validate", "model": "tiny", "variant": "b4-hadamard", "persist_rotation": persist,
            "bit_exact": persist, "max_abs_diff": 0.0 if persist else 3.1e-7, "backend": "cpu",
            "blas": env["blas"]["name"], "environment": env,
        }
    arts["bench/tiny/load.json"] = {
        "kind": "bench-load", "model": "tiny", "environment": env, "noise_floor": floor,
        "records": [
            _rec(LOAD_FULL, model="tiny", arm="safetensors", metric="load_s", unit="s", file_bytes=8_765_432),
            _rec(LOAD_RES, model="tiny", arm="reservoir", variant="b4-hadamard", persist_rotation=True,
                 metric="load_s", unit="s", file_bytes=1_300_000),
        ],
        "comparisons": [{"model": "tiny", "baseline_arm": "safetensors", "other_arm": "reservoir",
                         **compare(LOAD_FULL, LOAD_RES, floor)}],
    }
    decode_records = []
    for arm, precision, wbytes, tok_s in (
        ("full", "fp32", 8_000_000, [210.0, 205.0, 214.0]),
        ("vqpipe-b4", "vqpipe 4-bit", 1_100_000, [480.0, 470.0, 495.0]),
        ("affine-4", "mlx affine 4-bit", 1_250_000, [520.0, 515.0, 531.0]),
    ):
        for ctx in (128, 512):
            decode_records.append(_rec([t * (1 - ctx / 4096) for t in tok_s], model="tiny", arm=arm, precision=precision,
                                       phase="decode", context=ctx, unit="tok/s", weight_bytes=wbytes,
                                       kv_bytes_per_position=16_384, peak_memory_bytes=wbytes + 16_384 * ctx))
        decode_records.append(_rec([t * 9 for t in tok_s], model="tiny", arm=arm, precision=precision, phase="prefill",
                                   context=256, unit="tok/s", weight_bytes=wbytes, kv_bytes_per_position=16_384))
    arts["bench/tiny/decode.json"] = {
        "kind": "bench-decode", "model": "tiny", "environment": env, "noise_floor": 0.021,
        "roofline": {
            "copy_bandwidth": {**summarize([28.1e9, 27.5e9, 29.2e9]), "unit": "B/s", "method": "numpy"},
            "matmul_flops": {**summarize([201e9, 196e9, 204e9]), "unit": "FLOP/s", "dtype": "float32"},
            "matmul_params": 1_900_000,
        },
        "records": decode_records,
        "comparisons": [{"model": "tiny", "phase": "decode", "context": 128, "baseline_arm": "full",
                         "other_arm": "vqpipe-b4", **compare([1 / 210, 1 / 205, 1 / 214], [1 / 480, 1 / 470, 1 / 495], 0.021)}],
    }
    kivi_recs, kivi_comps = [], []
    for S in (64, 256, 1024):
        base = [1e-5 * S * f for f in (1.0, 1.03, 0.98)]
        fast = [t / (1 + S / 512) for t in base]
        kivi_recs += [_rec(base, op="qk", arm="dequant", S=S, unit="s"), _rec(fast, op="qk", arm="fused", S=S, unit="s")]
        kivi_comps.append({"op": "qk", "S": S, "baseline_arm": "dequant", "other_arm": "fused", **compare(base, fast, 0.03)})
    arts["bench/kivi.json"] = {"kind": "bench-kivi", "environment": env, "noise_floor": 0.03,
                               "records": kivi_recs, "comparisons": kivi_comps}
    arts["bench/tiny/quality.json"] = {
        "kind": "bench-quality", "model": "tiny", "environment": env,
        "records": [{"model": "tiny", "variant": "b4-hadamard", "metric": "perplexity", "dataset": "synthetic", "value": 12.5},
                    _rec([0.011, 0.013, 0.012], model="tiny", variant="b4-hadamard", metric="kl_divergence", dataset="synthetic")],
    }
    return arts


def _write(root, arts):
    for rel, doc in arts.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc))


def test_full_report(tmp_path, env):
    arts = _artifacts(env)
    _write(tmp_path / "in", arts)
    out = tmp_path / "report"
    assert report.main(["--inputs", str(tmp_path / "in"), "--out", str(out)]) == 0
    for name in report.OUTPUTS:
        assert (out / name).is_file(), name
    assert not list(out.rglob(".*tmp*"))
    for p in report.PLOTS:
        assert (out / "plots" / f"{p}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    s = json.loads((out / "summary.json").read_text())
    assert s["missing"] == [] and len(s["inputs"]) == len(arts)
    tiny = s["models"]["tiny"]
    assert [v["bit_exact"] for v in tiny["b4-hadamard"]["validate"]] in ([True, False], [False, True])
    assert tiny["b4-hadamard"]["quantize"]["quantized_bytes"] == 1_234_567
    load = tiny["b4-hadamard"]["load"][0]
    assert (load["n"], load["median"], load["min"], load["max"]) == (5, 0.050, 0.049, 0.055)
    assert {q["metric"] for q in tiny["b4-hadamard"]["quality"]} == {"perplexity", "kl_divergence"}
    dec = {(r["arm"], r["context"]): r for r in tiny["vqpipe-b4"]["decode"]}
    assert dec[("vqpipe-b4", 512)]["median"] == pytest.approx(480 * (1 - 512 / 4096))
    assert tiny["full"]["prefill"][0]["context"] == 256
    assert len(s["kernels"]["comparisons"]) == 3 and s["kernels"]["comparisons"][0]["verdict"]
    assert s["environments"][0]["environment"]["blas"]["name"] == env["blas"]["name"]
    assert {f["noise_floor"] for f in s["noise_floors"]} >= {0.021, 0.03}

    # roofline: achieved = (weights + KV * context) * tok/s, against the measured copy bandwidth
    roof = {(r["arm"], r["phase"], r["context"]): r for r in s["roofline"]}
    r = roof[("full", "decode", 512)]
    bpt = 8_000_000 + 16_384 * 512
    assert r["bytes_per_token"] == bpt
    assert r["achieved"]["median"]["percent_of_peak"] == pytest.approx(100 * bpt * dec_median(s, "full", 512) / 28.1e9)
    assert roof[("full", "prefill", 256)]["intensity"] > roof[("full", "decode", 128)]["intensity"]

    md = (out / "report.md").read_text()
    assert "min–max" in md and "| n |" in md
    assert "no measurable difference" in md or "faster" in md
    assert "![roofline](plots/roofline.png)" in md
    assert "Missing kinds: none" in md
    html = (out / "index.html").read_text()
    assert html.count("data:image/png;base64,") == len(report.PLOTS)
    assert not re.search(r"""(src|href)=["'](?!data:)""", html)  # self-contained
    assert "PASS (bit-exact)" in html and "FAIL" in html


def dec_median(s, arm, ctx):
    return next(r["median"] for r in s["models"]["tiny"][arm]["decode"] if r["context"] == ctx)


def test_missing_artifacts_and_paths(tmp_path, env):
    arts = {k: v for k, v in _artifacts(env).items() if "validate" in k}
    _write(tmp_path / "in", arts)
    (tmp_path / "in" / "junk.json").write_text("{not json")
    (tmp_path / "in" / "other.json").write_text(json.dumps({"hello": 1}))
    out = tmp_path / "r"
    assert report.main(["--inputs", str(tmp_path / "in"), str(tmp_path / "nope.json"), "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["missing"] == ["quantize", "bench-load", "bench-decode", "bench-kivi", "bench-quality"]
    assert s["missing_paths"] == [str(tmp_path / "nope.json")]
    assert {p["path"].rsplit("/", 1)[-1] for p in s["skipped"]} == {"junk.json", "other.json"}
    assert s["roofline"] == [] and s["kernels"]["comparisons"] == []
    md = (out / "report.md").read_text()
    assert "Missing kinds: quantize, bench-load, bench-decode, bench-kivi, bench-quality" in md
    for p in report.PLOTS:  # still written, saying why they are empty
        assert (out / "plots" / f"{p}.png").stat().st_size > 0


def test_malformed_parts_are_ignored(tmp_path, env):
    docs = {
        "kivi.json": {"kind": "bench-kivi", "environment": env, "records": "oops", "comparisons": [{"S": 1}]},
        "decode.json": {"kind": "bench-decode", "environment": env, "roofline": {"copy_bandwidth": None},
                        "records": [{"arm": "full", "phase": "decode", "context": 8}, 3]},
    }
    _write(tmp_path / "in", docs)
    s = report.make_report([tmp_path / "in"], tmp_path / "r")
    assert s["present"] == ["bench-decode", "bench-kivi"]
    assert s["kernels"]["records"] == [] and s["kernels"]["comparisons"] == [] and s["roofline"] == []
    assert s["models"] == {}


def test_mixed_blas_is_flagged(tmp_path, env):
    arts = {k: v for k, v in _artifacts(env).items() if "validate" in k}
    other = json.loads(json.dumps(env))
    other["blas"]["name"] = "openblas" if env["blas"]["name"] != "openblas" else "reference"
    key = next(iter(arts))
    arts[key] = {**arts[key], "environment": other, "blas": other["blas"]["name"]}
    _write(tmp_path / "in", arts)
    s = report.make_report([tmp_path / "in"], tmp_path / "r")
    assert any("different backend/BLAS setups" in w for w in s["warnings"])
    assert len(s["environments"]) == 2
    assert "Warning" in (tmp_path / "r" / "report.md").read_text()


def test_write_atomic_replaces(tmp_path):
    p = tmp_path / "a" / "x.txt"
    report.write_atomic(p, "one")
    report.write_atomic(p, b"two")
    assert p.read_text() == "two" and [q.name for q in p.parent.iterdir()] == ["x.txt"]
