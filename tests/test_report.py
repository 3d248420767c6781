import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vqpipe.store import record
from vqpipe.stages import report
from vqpipe.bench import compare, environment, noise_floor, summarize

REPO = Path(__file__).resolve().parents[1]

# Sample lists shaped like real runs (seconds or tok/s), run through the real harness helpers.
LOAD_RES = [0.051, 0.049, 0.050, 0.055, 0.050]
LOAD_RES_AA = [0.050, 0.052, 0.049, 0.051, 0.054]


@pytest.fixture(scope="module")
def env():
    return environment()


def _rec(samples, **keys):
    return {**keys, **summarize(samples)}


def _artifacts(env):
    """One record of every kind: the payloads the stages write (quantize.py, pack.py, validate.py,
    stages/bench_load.py, stages/bench_decode.py, stages/bench_kivi.py, stages/bench_quality.py) in record.make's envelope."""
    floor = noise_floor(LOAD_RES, LOAD_RES_AA)
    arts = {}
    q = "quantized/tiny/b4-hadamard"
    arts[f"{q}/quantized.json"] = record.make("quantize", {
        "source": "results/models/tiny/source", "bits": 4, "rotation": "hadamard",
        "seed": 0, "dtype": "float32", "quantize_seconds": 0.84, "peak_rss_bytes": 158_000_000,
        "records": [{"name": f"model.layers.{i}.mlp.up_proj", "kind": "linear", "rel_mse": 0.009 + 0.0001 * i,
                     "seconds": 0.25} for i in range(5)],
        "layers": {"model.layers.0.mlp.up_proj": {"in_features": 256, "out_features": 1024}},
    }, model="tiny", variant="b4-hadamard", environment=env)
    arts[f"{q}/reference.json"] = {"prompts": ["a", "b"], "environment": env}
    for persist in ("on", "off"):
        arts[f"reservoir/tiny/b4-hadamard/persist-{persist}/pack.json"] = record.make("pack", {
            "persist_rotation": persist == "on", "n_layers": 5, "seconds": 0.13, "quantized": q,
            "file_bytes": 12_719_104, "file_over_ideal": 1.0244,
        }, model="tiny", variant="b4-hadamard")
        arts[f"validate/tiny/b4-hadamard/persist-{persist}.json"] = record.make("validate", {
            "model": "tiny", "variant": "b4-hadamard", "persist_rotation": persist, "reservoir": "r", "reference": q,
            "bit_exact": persist == "on", "max_abs_diff": 0.0 if persist == "on" else 3.1e-7, "n_prompts": 4,
            "prompts": [{"index": i, "bit_exact": persist == "on"} for i in range(4)],
            "load_seconds": 4.7, "reason": "all 4 prompts bit-exact" if persist == "on" else "logits differ",
            "environment": env, "reference_environment": env,
        })
    arts["bench/tiny/load.json"] = record.make("bench-load", {
        "model": "tiny", "environment": env, "noise_floor": floor, "settings": {"bits": 4},
        "records": [
            {"arm": "requantize-hadamard", "variant": "b4-hadamard", "persist_rotation": None, **summarize([0.472])},
            {"arm": "reservoir-on-hadamard", "variant": "b4-hadamard", "persist_rotation": True, "file_bytes": 12_719_104,
             **summarize(LOAD_RES), "rss_bytes": summarize([97e6, 96e6, 98e6, 97e6, 97e6]),
             "mlx_peak_bytes": summarize([12_433_724] * 5)},
        ],
        "comparisons": [{"baseline_arm": "requantize-hadamard", "other_arm": "reservoir-on-hadamard",
                         **compare([0.472], LOAD_RES, floor)}],
        "targets": {"speedup requantize/reservoir-on hadamard (>= 1000)": {"value": 9.4, "met": False}},
        "checks": {"reservoir-on-hadamard logits byte-identical": True},
        "copy_paths": [{"method": "vqpipe", "bytes": 12_433_352, "copies": 1, **summarize([0.0168, 0.0170, 0.0166]),
                        "bytes_per_s": 12_433_352 / 0.0168}],
    })
    decode_records = []
    for arm, precision, wbytes, tok_s in (
        ("full", "fp32", 8_000_000, [210.0, 205.0, 214.0]),
        ("vqpipe-b4", "vqpipe 4-bit", 1_100_000, [480.0, 470.0, 495.0]),
        ("affine-4", "mlx affine 4-bit", 1_250_000, [520.0, 515.0, 531.0]),
    ):
        for ctx in (128, 512):
            rec = _rec([t * (1 - ctx / 4096) for t in tok_s], model="tiny", arm=arm, precision=precision,
                       phase="decode", context=ctx, unit="tok/s", weight_bytes=wbytes, flops_per_token=3_800_000,
                       kv_bytes_per_position=16_384, peak_memory_bytes=wbytes + 16_384 * ctx)
            bpt = wbytes + 16_384 * ctx  # as stages/bench_decode.py records them (roofline.py's formulas)
            rec.update(bytes_per_token=bpt, achieved={k: {"bytes_per_s": bpt * rec[k], "percent_of_peak": 100 * bpt * rec[k] / 28.1e9}
                                                      for k in ("median", "min", "max")})
            decode_records.append(rec)
        decode_records.append(_rec([t * 9 for t in tok_s], model="tiny", arm=arm, precision=precision, phase="prefill",
                                   context=256, unit="tok/s", weight_bytes=wbytes, kv_bytes_per_position=16_384,
                                   flops_per_token=3_800_000))
    arts["bench/tiny/decode.json"] = record.make("bench-decode", {
        "model": "tiny", "environment": env, "noise_floor": 0.021, "settings": {"quick": True},
        "roofline": {
            "copy_bandwidth": {**summarize([28.1e9, 27.5e9, 29.2e9]), "unit": "B/s", "method": "numpy"},
            "matmul_flops": {**summarize([201e9, 196e9, 204e9]), "unit": "FLOP/s", "dtype": "float32"},
            "matmul_params": 1_900_000,
        },
        "records": decode_records,
        "comparisons": [{"model": "tiny", "phase": "decode", "context": 128, "baseline_arm": "full",
                         "other_arm": "vqpipe-b4", **compare([1 / 210, 1 / 205, 1 / 214], [1 / 480, 1 / 470, 1 / 495], 0.021)}],
        "checks": [{"context": 128, "a": "full", "b": "full (A/A)", "what": "A/A: the baseline run twice",
                    "verdict": "byte-identical (generation is deterministic here)"}],
        "lossless": {"verdict": None},
    })
    rows = []
    for S in (64, 256, 1024):
        base = [1e-5 * S * f for f in (1.0, 1.03, 0.98)]
        fast = [t / (1 + S / 512) for t in base]
        floors = {"reference": noise_floor(base, base[::-1]), "kernel": 0.03}
        c = compare(base, fast, max(floors.values()))
        rows.append({"S": S, "kind": "keys", "mode": "isolated", "flushes_per_step": 1,
                     "arms": {"reference": summarize(base), "reference (A/A)": summarize(base[::-1]),
                              "kernel": summarize(fast), "kernel (A/A)": summarize(fast)},
                     "noise_floor": floors, "speedup": c["speedup"], "verdict": c["text"]})
    arts["bench/kivi.json"] = record.make("bench-kivi", {
        "environment": env, "backend": "metal", "config": {"quick": True},
        "copy_bandwidth": {**summarize([24.1e9, 23.9e9, 35.6e9]), "unit": "B/s", "method": "numpy", "bytes": 64 << 20},
        "harness_overhead_s": summarize([6.4e-6, 5.9e-6, 7.3e-6]), "results": rows})
    kv = {k: {"ppl": summarize(p), "kl": summarize(kl), "top1": summarize(t), "bytes_per_token": summarize(b)}
          for k, p, kl, t, b in (("fp", [40.0, 41, 42], [0, 0, 0], [1, 1, 1], [4096, 4096, 4096]),
                                 ("kivi4", [40.5, 41.4, 42.3], [0.02, 0.021, 0.019], [0.93, 0.92, 0.94], [700, 700, 700]),
                                 ("mlx-q4", [43, 44, 45], [0.18, 0.2, 0.19], [0.75, 0.74, 0.76], [640, 640, 640]))}
    arts["bench/tiny/kv_quality.json"] = record.make("bench-kv-quality", {
        "model": "tiny", "environment": env, "loaded": "vqpipe reservoir", "dtype": "float32",
        "config": {"windows": 3, "length": 1024, "chunk": 256, "kinds": ["fp", "kivi4", "mlx-q4"],
                   "kivi_residual": 128, "mlx_group": 64},
        "source_text": {"corpus": "devil", "title": "The Devil's Dictionary"}, "results": kv,
        "fp16_bytes_per_token": 2048.0, "windows": [{}, {}, {}],
        "paired": {"kivi4 vs mlx-q4": {"kivi_lower_kl": 3, "windows": 3, "kl_ratio": summarize([9.0, 9.5, 10.0])}}})
    arts["bench/tiny/quality.json"] = record.make("bench-quality", {
        "model": "tiny", "environment": env, "windows": 3, "length": 64, "source": {"method": "source"},
        "generations": {},
        "records": [{"bits": 4, "method": m, "weight_rel_mse": w, "kl": summarize(kl), "kl_mean": sum(kl) / 3,
                     "top1": summarize([0.4, 0.45, 0.43]), "top1_mean": 0.4267, "tokens": 640}
                    for m, w, kl in (("rotated", 0.009, [1.3, 1.2, 1.5]), ("affine", 0.015, [2.1, 2.0, 2.4]))],
        "timing": [{"rotation": "hadamard", "bits": 4, "seconds": summarize([0.8, 0.85, 0.9]),
                    "peak_rss_bytes": summarize([158e6, 160e6, 159e6]), "source_bytes": 30_000_000}],
    })
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
    assert s["missing"] == [] and len(s["inputs"]) == len(arts) - 1  # reference.json: not a record, passed over
    assert s["passed_over"] == 1 and s["warnings"] == []
    assert all(i["environment"] == "env1" for i in s["inputs"] if i["kind"] != "pack")
    tiny = s["models"]["tiny"]
    b4 = tiny["b4-hadamard"]
    assert sorted((v["persist_rotation"], v["bit_exact"]) for v in b4["validate"]) == [("off", False), ("on", True)]
    (q,) = b4["quantize"]  # model, variant and environment from the record's envelope
    assert q["layers"] == 5 and q["environment"] == "env1"
    assert q["layer_rel_mse"] == {"n": 5, "median": pytest.approx(0.0092), "min": 0.009, "max": pytest.approx(0.0094)}
    assert sorted(p["persist"] for p in b4["pack"]) == ["off", "on"]
    load = {r["arm"]: r for r in b4["load"]}
    res = load["reservoir-on-hadamard"]
    assert (res["n"], res["median"], res["min"], res["max"]) == (5, 0.050, 0.049, 0.055)
    assert res["rss_bytes"]["median"] == 97e6 and res["noise_floor"] == noise_floor(LOAD_RES, LOAD_RES_AA)
    assert load["requantize-hadamard"]["n"] == 1
    kl = {(r["method"], r["metric"]): r for v in tiny.values() for r in v.get("quality", [])}
    assert kl[("rotated", "kl")]["median"] == 1.3 and kl[("affine", "kl")]["max"] == 2.4
    assert {r["variant"] for r in kl.values()} == {"b4-auto", "mlx-affine-b4"}
    assert b4["quantize_timing"][0]["seconds"]["n"] == 3
    dec = {(r["arm"], r["context"]): r for r in tiny["vqpipe-b4"]["decode"]}
    assert dec[("vqpipe-b4", 512)]["median"] == pytest.approx(480 * (1 - 512 / 4096))
    assert tiny["full"]["prefill"][0]["context"] == 256
    kc = s["kernels"]["comparisons"]
    assert [c["S"] for c in kc] == [64, 256, 1024] and kc[2]["speedup"] == pytest.approx(3.0)
    base = [1e-5 * 64 * f for f in (1.0, 1.03, 0.98)]
    assert kc[0]["floor"] == max(noise_floor(base, base[::-1]), 0.03)
    assert len(s["kernels"]["records"]) == 12
    assert s["environments"][0]["environment"]["blas"]["name"] == env["blas"]["name"]
    assert {f["kind"] for f in s["noise_floors"]} == {"bench-load", "bench-decode", "bench-kivi"}
    assert sorted(b["median"] for b in s["copy_bandwidth"]) == [24.1e9, 28.1e9]
    assert {a["kind"] for a in s["artifacts"]} == set(report.KINDS)
    assert "layers" not in next(a["data"] for a in s["artifacts"] if a["kind"] == "quantize")

    # roofline: achieved = (weights + KV * context) * tok/s, against the measured copy bandwidth
    roof = {(r["arm"], r["phase"], r["context"]): r for r in s["roofline"]}
    r = roof[("full", "decode", 512)]
    bpt = 8_000_000 + 16_384 * 512
    assert r["bytes_per_token"] == bpt
    full_tok_s = 210 * (1 - 512 / 4096)  # median of the full arm at context 512
    assert r["achieved"]["median"]["percent_of_peak"] == pytest.approx(100 * bpt * full_tok_s / 28.1e9)
    assert roof[("full", "prefill", 256)]["intensity"] > roof[("full", "decode", 128)]["intensity"]

    md = (out / "report.md").read_text()
    assert "min–max" in md and "| n |" in md
    assert "no measurable difference" in md or "faster" in md
    assert "![roofline](plots/roofline.png)" in md
    assert "Missing kinds: none" in md
    html = (out / "index.html").read_text()
    assert html.count("data:image/png;base64,") == len(report.PLOTS)
    assert not re.search(r"""(src|href)=["'](?!data:)""", html)  # self-contained
    assert "PASS (bit-exact)" in html and "FAIL" in html and "NOT met" not in html  # targets: summary.json only
    assert "byte-identical (generation is deterministic here)" in md and "lossless: not established" in md
    # One page per named table, for Snakemake's report: the same rows as report.md's table.
    page = (out / "tables" / "validate.html").read_text()
    assert page.count("<tr>") == 3 and "PASS (bit-exact)" in page and "<th>persist_rotation</th>" in page
    assert "| tiny | b4-hadamard | on | PASS (bit-exact) | 4 | 0 | 4.7 | env1 | all 4 prompts bit-exact |" in md


def test_missing_kinds_and_passed_over(tmp_path, env):
    arts = {k: v for k, v in _artifacts(env).items() if "validate" in k}
    _write(tmp_path / "in", arts)
    (tmp_path / "in" / "junk.json").write_text("{not json")  # in a directory: not a record, passed over
    (tmp_path / "in" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    out = tmp_path / "r"
    assert report.main(["--inputs", str(tmp_path / "in"), "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["missing"] == ["quantize", "pack", "bench-load", "bench-decode", "bench-kivi", "bench-kv-quality",
                            "bench-quality"]
    assert s["passed_over"] == 2 and len(s["inputs"]) == 2
    assert s["roofline"] == [] and s["kernels"]["comparisons"] == []
    md = (out / "report.md").read_text()
    assert "Missing kinds: quantize, pack, bench-load, bench-decode, bench-kivi, bench-kv-quality, bench-quality" in md
    for p in report.PLOTS:  # still written, saying why they are empty
        assert (out / "plots" / f"{p}.png").stat().st_size > 0
    assert "(no bench-kivi artifact)" in (out / "tables" / "kernels.html").read_text()


def _refused(capsys, args, out):
    assert report.main([*args, "--out", str(out)]) == 2
    assert not out.exists()  # nothing written, not even a partial report
    return capsys.readouterr().err


def test_malformed_record_is_refused(tmp_path, env, capsys):
    """A record that does not fit the schema stops the report; the message names the file and the field."""
    arts = {k: v for k, v in _artifacts(env).items() if k.startswith("bench/")}
    arts["bench/tiny/load.json"]["records"][1]["median"] = "fast"
    _write(tmp_path / "in", arts)
    err = _refused(capsys, ["--inputs", str(tmp_path / "in")], tmp_path / "r")
    assert f"{tmp_path / 'in' / 'bench/tiny/load.json'}: field 'records/1/median': 'fast' is not of type 'number'" in err

    del arts["bench/tiny/load.json"]
    del arts["bench/tiny/decode.json"]["roofline"]["copy_bandwidth"]
    _write(tmp_path / "in2", arts)
    err = _refused(capsys, ["--inputs", str(tmp_path / "in2" / "bench/tiny/decode.json")], tmp_path / "r")
    assert "decode.json: field 'roofline': 'copy_bandwidth' is a required property" in err

    bad_env = {**arts["bench/kivi.json"], "environment": {"backend": "cpu"}}
    _write(tmp_path / "in3", {"kivi.json": bad_env})
    err = _refused(capsys, ["--inputs", str(tmp_path / "in3")], tmp_path / "r")
    assert "kivi.json: field 'environment'" in err


def test_inputs_that_are_not_records_are_refused(tmp_path, env, capsys):
    (tmp_path / "other.json").write_text(json.dumps({"kind": "bench-load", "records": []}))  # an old artifact
    err = _refused(capsys, ["--inputs", str(tmp_path / "other.json")], tmp_path / "r")
    assert f"{tmp_path / 'other.json'}: not a vqpipe record (no 'record' field)" in err
    (tmp_path / "junk.json").write_text("{not json")
    assert "junk.json: cannot read a record" in _refused(capsys, ["--inputs", str(tmp_path / "junk.json")], tmp_path / "r")
    err = _refused(capsys, ["--inputs", str(tmp_path / "nope.json")], tmp_path / "r")
    assert f"{tmp_path / 'nope.json'}: no such input file or directory" in err


def test_record_envelope_and_write(tmp_path, env):
    doc = record.make("pack", {"kind": "pack", "persist_rotation": True, "n_layers": 1, "seconds": 0.1, "quantized": "q",
                               "file_bytes": 10, "file_over_ideal": 1.0}, model="tiny", variant="b4-auto",
                      inputs={"quantized": Path("q")})
    assert {k: doc[k] for k in ("record", "stage", "kind", "model", "variant", "environment", "inputs")} == {
        "record": 1, "stage": "pack", "kind": "pack", "model": "tiny", "variant": "b4-auto", "environment": None,
        "inputs": {"quantized": "q"}}
    assert set(doc["software"]) == {"python", "mlx", "mlx-lm", "numpy"}
    with pytest.raises(ValueError, match="payload key 'model' = 'other' differs"):
        record.make("pack", {"model": "other"}, model="tiny")
    with pytest.raises(ValueError, match="unknown stage"):
        record.make("bench-nothing", {})
    path = tmp_path / "pack.json"
    record.write(path, "pack", {k: v for k, v in doc.items() if k not in record.ENVELOPE})
    assert record.read(path)["n_layers"] == 1
    with pytest.raises(record.RecordError, match="field 'n_layers': 'one' is not of type 'integer'"):
        record.write(tmp_path / "bad.json", "pack", {**doc, "n_layers": "one", "software": None})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack.json"]  # the bad record was never written


def test_report_renders_without_mlx(tmp_path, env):
    """summary, plots and pages need no MLX: a report can be built from copied records anywhere."""
    _write(tmp_path / "in", _artifacts(env))
    code = ("import sys; from vqpipe.stages import report; "
            f"rc = report.main(['--inputs', {str(tmp_path / 'in')!r}, '--out', {str(tmp_path / 'r')!r}]); "
            "assert rc == 0, rc; assert 'mlx' not in sys.modules, sorted(m for m in sys.modules if 'mlx' in m)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    for name in report.OUTPUTS:
        assert (tmp_path / "r" / name).is_file(), name


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


def test_write_bytes_replaces(tmp_path):
    from vqpipe.store.fsutil import write_bytes

    p = tmp_path / "a" / "x.txt"
    write_bytes(p, "one")
    write_bytes(p, b"two")
    assert p.read_text() == "two" and [q.name for q in p.parent.iterdir()] == ["x.txt"]


def test_decode_extras_and_kivi_kind(tmp_path, env):
    """bench-decode's amdahl, checks/lossless and skipped_arms are rendered; the generation's own peak is
    used where recorded; bench-kivi renders ratio, GB/s and outputs."""
    arts = {k: v for k, v in _artifacts(env).items() if k in ("bench/tiny/decode.json", "bench/kivi.json")}
    dec = arts["bench/tiny/decode.json"]
    for r in dec["records"]:
        r["peak_over_start_bytes"] = 7 * 2**20
    ref, ker = summarize([6.0e-3, 5.5e-3, 6.2e-3]), summarize([7.4e-3, 4.9e-3, 8.1e-3])
    dec["amdahl"] = [{"model": "tiny", "weights": "full", "context": 128, "baseline_arm": "full/kivi-ref",
                      "other_arm": "full/kivi-kernel",
                      "decode": {"launches_per_layer": 4, "layers": 24, "saving_s_per_token": 1.013e-4,
                                 "predicted_speedup_max": 1.0116,
                                 "measured": {"floor": 0.05, "reference_s_per_token": ref, "kernel_s_per_token": ker,
                                              "speedup": 1.30, "predicted_speedup_max_with_measured_reference": 1.017,
                                              "verdict": "1.30x faster"}}},
                     {"model": "tiny", "weights": "vqpipe", "context": 128, "reason": "no --kivi-ops: no op-level kernel figures"}]
    dec["checks"] = [
        {"context": 128, "a": "full/fp", "b": "full/fp (A/A)", "what": "A/A", "identical": False, "pairs": 3,
         "identical_ids": 2, "token_agreement": summarize([1.0, 1.0, 0.28]), "verdict": "DIFFERENT"},
        {"context": 128, "a": "full/kivi-ref", "b": "full/kivi-kernel", "what": "kernels on vs off (lossless)",
         "identical": False, "pairs": 4, "identical_ids": 3, "first_difference": summarize([3]), "verdict": "DIFFERENT"}]
    dec["lossless"] = {"all_identical": False, "required": dec["checks"]}
    dec["skipped_arms"] = [{"arm": "vqpipe/kivi-kernel", "reason": "no Metal/CUDA backend"}]
    kivi = arts["bench/kivi.json"]
    kivi["kind"] = "bench-kivi"
    for row in kivi["results"]:
        row.update(kernel_bytes=1000, kernel_bytes_per_s=2.5e9, fraction_of_copy_bandwidth=0.1, outputs_equal=True)
    _write(tmp_path / "in", arts)
    out = tmp_path / "r"
    s = report.make_report([tmp_path / "in"], out)
    assert {"bench-decode", "bench-kivi"} <= set(s["present"])
    (x,) = [x for x in s["extras"] if x["kind"] == "bench-decode"]
    assert x["skipped_arms"][0]["arm"] == "vqpipe/kivi-kernel" and len(x["amdahl"]) == 2
    md = (out / "report.md").read_text()
    html = (out / "index.html").read_text()
    for text in ("vqpipe/kivi-kernel | no Metal/CUDA backend", "no --kivi-ops: no op-level kernel figures",
                 "kernels on vs off lossless: NO (0 of 1", "inconclusive: the baseline's A/A differed",
                 "1 [0.28–1], n = 3", "| 4 × 24 | 101.3 | 1.012 | 3 | 6 | 5.5–6.2 | 3 | 7.4 | 4.9–8.1 | 1.3 | 1.017 | ±5.0% |",
                 "NO (above it beyond the noise floor)", "7.00 MiB", "generation's own peak"):
        assert text in md, text
    assert "no Metal/CUDA backend" in html and "Amdahl" in html
    kc = {(c["op"], c["S"]): c for c in s["kernels"]["comparisons"]}
    assert kc[("keys", 1024)]["ratio"] == pytest.approx(1 / 3.0) and kc[("keys", 64)]["kernel_bytes_per_s"] == 2.5e9
    row = next(line for line in md.splitlines() if line.startswith("| keys | isolated | 1024 |"))
    assert "| 0.3333 | 3 |" in row and "| 2.5 | 10.0% | yes |" in row
