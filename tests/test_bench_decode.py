"""bench-decode: one short run on the synthetic tiny model (plus a no-flush run), and the pure parts
(KIVI flush schedule, Amdahl arithmetic, lossless verdicts, prompts)."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest

from vqpipe import kivi
from vqpipe.store import reservoir as R
from vqpipe.bench import AA_SUFFIX
from vqpipe.stages import bench_decode
from vqpipe.bench import roofline as rl

# A short run (the vqpipe arms cost ~0.5 s per forward on this CPU): one prompt length crossing the
# 32-token prefill chunk; G=4, R=8, so KIVI flushes in both phases (prefill launches of 24, 4, 4
# tokens per layer, decode one of 4). tests/test_workflow.py and the --quick CLI run two lengths.
P, N, G, RES, STEP, REPEATS = 40, 4, 4, 8, 32, 2
# Op-level flush times (seconds) in bench-kivi's own shape, as if measured on a GPU.
OPS = {"stage": "bench-kivi", "environment": {"backend": "gpu", "gpu_name": "test"},
       "config": {"heads": 2, "head_dim": 64, "dtype": "float32"},
       "results": [
           {"S": 4, "kind": "flush", "mode": "in_graph", "arms": {"reference": {"median": 3e-4}, "kernel": {"median": 1e-4}}},
           {"S": 64, "kind": "flush", "mode": "in_graph", "arms": {"reference": {"median": 9e-4}, "kernel": {"median": 2e-4}}},
           {"S": 4, "kind": "keys", "mode": "in_graph", "arms": {"reference": {"median": 1.0}, "kernel": {"median": 0.5}}},
           {"S": 4, "kind": "flush", "mode": "isolated", "arms": {"reference": {"median": 1.0}, "kernel": {"median": 0.1}}},
       ]}


@pytest.fixture(scope="module")
def reservoir(tiny_b4_reservoir):
    return tiny_b4_reservoir


@pytest.fixture(scope="module")
def run(tiny_source, reservoir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_decode_run")
    (root / "ops.json").write_text(json.dumps(OPS))
    out = root / "bench_decode.json"
    rc = bench_decode.main(["--source", str(tiny_source), "--reservoir", str(reservoir), "--model", "tiny", "--quick",
                      "--prompt-lengths", str(P), "--gen-tokens", str(N), "--group-size", str(G),
                      "--residual", str(RES), "--prefill-step", str(STEP), "--repeats", str(REPEATS),
                      "--copy-mib", "16", "--gemm", "256", "--load-repeats", "1", "--kivi-ops", str(root / "ops.json"), "--out", str(out)])
    assert rc == 0
    return json.loads(out.read_text()), out


def test_fresh_loads(run):
    """Every weights arm loaded in fresh processes: the reservoir by vqpipe.load, the source and the
    affine conversions (saved as mlx_lm.convert would) by mlx_lm.load; each phase timed."""
    doc, _ = run
    fl = doc["fresh_load"]
    assert fl["repeats"] == 1 and fl["noise_floor"] >= 0
    recs = {r["arm"]: r for r in fl["records"]}
    assert list(recs) == ["full", "vqpipe", "affine4", "affine8"]
    assert recs["vqpipe"]["loader"] == "vqpipe" and recs["full"]["loader"] == recs["affine4"]["loader"] == "mlx_lm"
    for r in recs.values():
        assert r["n"] == 1 and r["median"] > 0 and r["precision"]
        phases = r["import_s"]["median"] + r["load_s"]["median"] + r["first_logits_s"]["median"]
        assert r["median"] == pytest.approx(phases)
        assert r["import_s"]["median"] > 0 and r["mlx_peak_bytes"]["median"] > 0
    assert {c["other_arm"] for c in fl["comparisons"]} == {"vqpipe", "affine4", "affine8"}
    assert all(c["baseline_arm"] == "full" and c["ratio"] > 0 for c in fl["comparisons"])


def test_fresh_load_rejects_a_broken_model(tmp_path):
    from vqpipe.bench import fresh_load

    with pytest.raises(RuntimeError, match="fresh process failed"):
        fresh_load.sample("vqpipe", tmp_path)
    with pytest.raises(ValueError, match="unknown loader"):
        fresh_load.sample("torch", tmp_path)


def _records(doc, **kw):
    return [r for r in doc["records"] if all(r.get(k) == v for k, v in kw.items())]


def test_json_has_every_field(run):
    doc, path = run
    assert doc["kind"] == "bench-decode" and doc["model"] == "tiny"
    assert doc["environment"]["backend"] in ("cpu", "gpu") and "blas" in doc["environment"]
    assert 0 <= doc["noise_floor"] == max(f["noise_floor"] for f in doc["noise_floors"])
    roof = doc["roofline"]
    assert roof["copy_bandwidth"]["median"] > 0 and roof["matmul_flops"]["median"] > 0 and roof["matmul_params"] > 0
    arms = [a["arm"] for a in doc["arms"]]
    want = ["full/fp", "full/kivi-ref", "vqpipe/fp", "vqpipe/kivi-ref", "affine4/fp", "affine8/fp"]
    assert [a for a in arms if not a.endswith("kivi-kernel")] == want
    assert doc["baseline_arm"] == "full/fp"
    for arm in arms:
        for phase in ("prefill", "decode"):
            for ctx in (P,):
                (rec,) = _records(doc, arm=arm, phase=phase, context=ctx)
                assert rec["unit"] == "tok/s" and rec["n"] == REPEATS
                assert 0 < rec["min"] <= rec["median"] <= rec["max"]
                toks = ctx if phase == "prefill" else N
                secs = [r[f"{phase}_s"] for r in doc["runs"] if r.get("round") == "timed" and r["arm"] == arm
                        and r["context"] == ctx]
                rates = sorted(toks / x for x in secs)
                assert (rec["min"], rec["max"]) == (rates[0], rates[-1]) and len(secs) == REPEATS
                assert rec["median"] == pytest.approx(float(np.median(rates)))
                assert rec["peak_memory_bytes"] >= rec["peak_over_start_bytes"] >= 0
                assert rec["peak_memory_bytes"] > rec["model_bytes"] > 0
                assert set(rec["kv_bytes"]) >= {"resident_bytes", "compressed_bytes", "uncompressed_bytes", "offset"}
                assert rec["noise_floor"] == next(f["noise_floor"] for f in doc["noise_floors"]
                                                  if f["context"] == ctx and f["phase"] == phase)
    pairs = {(c["baseline_arm"], c["other_arm"], c["phase"], c["context"]) for c in doc["comparisons"]}
    for arm in arms[1:]:
        assert ("full/fp", arm, "decode", P) in pairs
    assert ("vqpipe/fp", "vqpipe/kivi-ref", "prefill", P) in pairs
    for c in doc["comparisons"]:
        assert c["baseline"]["n"] == c["other"]["n"] == REPEATS and c["verdict"]

    # The report reads it: decode and prefill records per arm, one roofline row per precision.
    from vqpipe.report.summary import summary as summarize_records

    summary = summarize_records([str(path)])  # checks the record against the schema first
    assert "bench-decode" in summary["present"]
    assert len(summary["models"]["tiny"]["vqpipe/fp"]["decode"]) == 1
    precisions = {(r["precision"], r["phase"], r["context"]) for r in summary["roofline"]}
    assert len(precisions) == len(summary["roofline"]) == 4 * 2  # 4 precisions x 2 phases


@pytest.mark.skipif(kivi.kernels_active(None), reason="a GPU backend is present: the kernel arm runs")
def test_kernel_arm_skipped_with_reason_on_cpu(run):
    doc, _ = run
    skipped = {s["arm"]: s["reason"] for s in doc["skipped_arms"]}
    assert set(skipped) == {"full/kivi-kernel", "vqpipe/kivi-kernel"}
    assert all("Metal or CUDA" in r for r in skipped.values())
    kernel_checks = [c for c in doc["checks"] if c["b"].endswith("kivi-kernel")]
    assert len(kernel_checks) == 2 and all(c["verdict"].startswith("skipped:") for c in kernel_checks)
    assert doc["lossless"]["verdict"] is None
    assert not _records(doc, cache="kivi-kernel")


def test_flush_counts_and_kv_bytes(run):
    doc, _ = run
    kvpp = doc["roofline"]["kv_bytes_per_position"]
    assert kvpp == rl.kv_bytes_per_position({"num_hidden_layers": 2, "num_attention_heads": 4,
                                             "num_key_value_heads": 2, "hidden_size": 256}, 4)
    for ctx in (P,):
        groups = lambda t: max(0, t - RES) // G  # noqa: E731  groups quantized after t tokens, per layer
        for rec in _records(doc, cache="kivi-ref", context=ctx):
            f = rec["flushes"]
            assert f["layers"] == 2
            assert f["prefill"] == 2 * groups(ctx) > 0
            assert f["decode"] == 2 * (groups(ctx + N) - groups(ctx)) > 0
            assert f["total_measured"] == f["prefill"] + f["decode"] == rec["kv_bytes"]["flushes"]
            kv = rec["kv_bytes"]
            assert kv["offset"] == ctx + N and kv["quantized_tokens"] == G * groups(ctx + N)
            assert kv["uncompressed_bytes"] == kvpp * (ctx + N)
            assert kv["compressed_bytes"] < kv["uncompressed_bytes"] < kv["resident_bytes"]
        for rec in _records(doc, cache="fp", context=ctx):
            kv = rec["kv_bytes"]
            assert "flushes" not in rec and kv["flushes"] == 0
            assert kv["compressed_bytes"] == kv["uncompressed_bytes"] == kvpp * (ctx + N) <= kv["resident_bytes"]


def _logical_bytes(spec, itemsize=None):
    sizes = {"float32": 4, "uint32": 4, "bfloat16": 2, "float16": 2}
    return int(np.prod(spec["shape"])) * (itemsize or sizes[spec["dtype"]])


def test_roofline_from_measured_inputs(run, tiny_source, reservoir):
    doc, _ = run
    roof = doc["roofline"]
    weights = roof["weights"]
    # full fp32, tied embedding (read in full as the output head): 4 bytes x every parameter.
    n_params = sum(v.size for v in mx.load(str(next(tiny_source.glob("*.safetensors")))).values())
    assert weights["full"]["weight_bytes"] == 4 * n_params
    # vqpipe: every tensor the reservoir stores for a layer (packed bits, scales, codebook, rotation)
    # as stored, plus every other parameter at the compute dtype (float32 here: the bench casts the
    # source-dtype norms), read from the file's header, not from the loaded model.
    h = R.read_header(reservoir / R.FILE_NAME)
    vq = sum(_logical_bytes(s) for m in h["layers"].values() for s in m["tensors"].values())
    vq += sum(_logical_bytes(s, 4) for s in h["params"].values())
    assert weights["vqpipe"]["weight_bytes"] == vq
    assert weights["full"]["weight_bytes"] / weights["vqpipe"]["weight_bytes"] == pytest.approx(4 * n_params / vq, rel=1e-12)
    assert weights["vqpipe"]["weight_bytes"] < weights["affine4"]["weight_bytes"] < weights["affine8"]["weight_bytes"] < weights["full"]["weight_bytes"]
    bw, fl = roof["copy_bandwidth"]["median"], roof["matmul_flops"]["median"]
    for rec in doc["records"]:
        if rec["cache"] != "fp":
            assert "weight_bytes" not in rec  # one roofline point per weight precision
            continue
        assert rec["weight_bytes"] == weights[rec["weights"]]["weight_bytes"]
        if rec["phase"] == "decode":
            mean_ctx = rec["context"] + (N + 1) / 2
            assert rec["bytes_per_token"] == int(rec["weight_bytes"] + roof["kv_bytes_per_position"] * mean_ctx)
            for k in ("median", "min", "max"):
                a = rec["achieved"][k]
                assert a["bytes_per_s"] == pytest.approx(rec["bytes_per_token"] * rec[k])
                assert a["percent_of_peak"] == pytest.approx(100 * rec["bytes_per_token"] * rec[k] / bw)
        else:
            assert rec["achieved_flops"]["median"]["percent_of_peak"] == pytest.approx(
                100 * rec["flops_per_token"] * rec["median"] / fl)


def test_prompts_distinct_and_rotating(run):
    doc, _ = run
    runs = [r for r in doc["runs"] if "round" in r]
    for ctx in (P,):
        seqs = {}
        for r in runs:
            if r["context"] == ctx:
                seqs.setdefault(r["arm"], []).append((r["round"], r["prompt"]))
        assert set(seqs) == {a["arm"] for a in doc["arms"]} | {"full/fp" + AA_SUFFIX}
        timed = {arm: [p for rnd, p in s if rnd == "timed"] for arm, s in seqs.items()}
        # every arm sees the same prompts in the same order, each prompt once, never back to back
        assert len({tuple(t) for t in timed.values()}) == 1
        for arm, s in seqs.items():
            prompts = [p for _, p in s]
            assert len(set(prompts)) == len(prompts)
            assert all(a != b for a, b in zip(prompts, prompts[1:]))
            if arm != "full/fp" + AA_SUFFIX:
                assert [rnd for rnd, _ in s] == ["pilot"] + ["timed"] * REPEATS


def test_build_prompts_distinct(tiny_source):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(tiny_source)
    prompts = bench_decode.build_prompts(tok, 20, 96)
    assert len(prompts) == 20 and all(p.shape == (96,) for p in prompts)
    assert len({tuple(p.tolist()) for p in prompts}) == 20


def test_amdahl_prediction(run):
    doc, _ = run
    preds = {(a["weights"], a["context"]): a for a in doc["amdahl"]}
    assert set(preds) == {(w, c) for w in ("full", "vqpipe") for c in (P,)}
    for (w, ctx), a in preds.items():
        d = a["decode"]
        # decode: one flush launch of G = 4 tokens per layer; nearest op row S=4, in-graph mode.
        assert d["launches_per_layer"] == 1 and d["layers"] == 2
        assert d["op_rows"] == [{"S": 4, "mode": "in_graph", "reference_s": 3e-4, "kernel_s": 1e-4}]
        assert d["saving_s"] == pytest.approx(2 * 2e-4)
        assert d["saving_s_per_token"] == pytest.approx(2 * 2e-4 / N)
        t = d["pilot_reference_s"]
        assert t == pytest.approx(next(r for r in doc["runs"] if r.get("round") == "pilot" and r["context"] == ctx
                                       and r["arm"] == f"{w}/kivi-ref")["decode_s"])
        assert d["predicted_speedup_max"] == pytest.approx(t / (t - 4e-4))
        p = a["prefill"]
        sched = bench_decode.flush_schedule(ctx, N, RES, G, STEP)["prefill"]
        want = sum(2 * ((9e-4 - 2e-4) if abs(math.log(s / 64)) < abs(math.log(s / 4)) else 2e-4) for s in sched)
        assert p["saving_s"] == pytest.approx(want)
        # no kernel arm on the CPU: nothing measured to set beside it
        if not kivi.kernels_active(None):
            assert "measured" not in d and a["measured"].startswith("not measured")


def test_kivi_equals_fp_cache_without_flush(tiny_source, tmp_path):
    """residual_length beyond prompt + generation: KIVI never flushes, so it is the fp cache."""
    out = tmp_path / "noflush.json"
    assert bench_decode.main(["--source", str(tiny_source), "--model", "tiny", "--weights", "full", "--caches", "fp", "kivi-ref",
                        "--quick", "--prompt-lengths", "40", "--gen-tokens", "6", "--residual", "64", "--repeats", "2",
                        "--copy-mib", "16", "--gemm", "128", "--load-repeats", "0", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "fresh_load" not in doc
    (chk,) = [c for c in doc["checks"] if c["b"] == "full/kivi-ref"]
    assert chk["a"] == "full/fp" and chk["pairs"] == 3 and chk["identical"] is True
    assert chk["identical_text"] == 3 and chk["token_agreement"]["min"] == 1.0
    for rec in _records(doc, cache="kivi-ref"):
        assert rec["flushes"]["total_measured"] == 0 and rec["kv_bytes"]["quantized_tokens"] == 0


def test_flush_schedule_matches_the_cache():
    assert bench_decode.flush_schedule(4096, 128, 128, 32, 2048) == {"prefill": [1920, 2016, 32], "decode": [32] * 4}
    assert bench_decode.flush_schedule(512, 128, 128, 32, 2048) == {"prefill": [352, 32], "decode": [32] * 4}
    assert bench_decode.flush_schedule(100, 10, 200, 32, 2048) == {"prefill": [], "decode": []}
    # drive a real KIVICache with the same chunks and count its flushes
    for P, n, r, g, step in ((150, 20, 16, 8, 64), (4096, 128, 128, 32, 2048), (33, 3, 0, 4, 8)):
        cache = kivi.KIVICache(4, g, r, use_kernels=False)
        sched = bench_decode.flush_schedule(P, n, r, g, step)
        chunks = [min(step, P - 1 - t) for t in range(0, P - 1, step)] + [1] * (1 + n)
        seen = []
        for c in chunks:
            before = cache.flushes
            cache.update_and_fetch(mx.zeros((1, 1, c, 4)), mx.zeros((1, 1, c, 4)))
            if cache.flushes > before:
                seen.append((cache.flushes - before) * g)
        assert seen == sched["prefill"] + sched["decode"]


def test_op_time_and_amdahl_arithmetic(tmp_path):
    (tmp_path / "ops.json").write_text(json.dumps(OPS))
    ops = bench_decode.load_kivi_ops(tmp_path / "ops.json")
    assert bench_decode.op_time(ops, 5) == {"S": 4, "mode": "in_graph", "reference_s": 3e-4, "kernel_s": 1e-4}
    assert bench_decode.op_time(ops, 2000)["S"] == 64
    assert bench_decode.predict_saving([4, 4, 60], 3, ops)["saving_s"] == pytest.approx(3 * (2e-4 + 2e-4 + 7e-4))
    assert bench_decode.amdahl_speedup(10.0, 1.0) == pytest.approx(10 / 9)
    assert bench_decode.amdahl_speedup(1.0, 2.0) == math.inf
    no_kernel = {"rows": [{"S": 4, "mode": "isolated", "reference": 1e-4, "kernel": None}]}
    assert bench_decode.predict_saving([4], 2, no_kernel) is None


def test_lossless_verdicts():
    class Tok:
        def decode(self, ids):
            return " ".join(map(str, ids))

    same = bench_decode.compare_outputs({0: [[1, 2, 3]], 1: [[4, 5, 6]]}, {0: [[1, 2, 3]], 1: [[4, 5, 6]]}, Tok(), True)
    assert same["identical"] and same["verdict"] == "byte-identical" and same["pairs"] == 2
    diff = bench_decode.compare_outputs({0: [[1, 2, 3]], 1: [[4, 5, 6]]}, {0: [[1, 2, 3]], 1: [[4, 5, 7]]}, Tok(), True)
    assert diff["identical"] is False and diff["verdict"] == "DIFFERENT" and diff["first_difference"]["median"] == 2
    assert diff["identical_ids"] == 1 and diff["token_agreement"]["min"] == pytest.approx(2 / 3)
    conclusive = bench_decode.lossless_verdict(dict(diff), deterministic=True)
    assert conclusive["conclusive"] is True and conclusive["verdict"].startswith("DIFFERENT on 1/2 prompts (first difference at token 2)")
    inconclusive = bench_decode.lossless_verdict(dict(diff), deterministic=False)
    assert inconclusive["conclusive"] is False and "inconclusive" in inconclusive["verdict"]
    lossy = bench_decode.compare_outputs({0: [[1, 2]]}, {0: [[1, 3]]}, Tok(), False)
    assert lossy["verdict"].startswith("0/1 identical") and bench_decode.lossless_verdict(lossy, False) is lossy


def test_cli_rejects_bad_settings(tiny_source, tmp_path):
    base = ["--source", str(tiny_source), "--out", str(tmp_path / "x.json"), "--weights", "full"]
    for extra in (["--prompts", "5"], ["--prompt-lengths", "1"], ["--caches", "kivi-ref"]):
        with pytest.raises(SystemExit):
            bench_decode.parse_args(base + extra)
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--source", str(tiny_source), "--out", "x.json"])  # vqpipe arm without --reservoir
    args = bench_decode.parse_args(base + ["--quick", "--gen-tokens", "5"])
    assert args.gen_tokens == 5 and args.prompt_lengths == bench_decode.QUICK["prompt_lengths"] and args.warmup_tokens == 5


def test_compiled_step_arms(tiny_source, tmp_path):
    """The compiled-step caches run beside the eager fp cache; in float32 on the CPU they give the
    eager texts exactly (tests/test_decode_step.py tests the step itself)."""
    out = tmp_path / "compiled.json"
    assert bench_decode.main(["--source", str(tiny_source), "--model", "tiny", "--weights", "full", "affine4",
                              "--caches", "fp", "compiled", "compiled-split", "--quick", "--prompt-lengths", "40",
                              "--gen-tokens", "6", "--repeats", "2", "--copy-mib", "16", "--gemm", "128",
                              "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    arms = {r["arm"] for r in doc["records"]}
    assert arms == {f"{w}/{c}" for w in ("full", "affine4") for c in ("fp", "compiled", "compiled-split")}
    for rec in _records(doc, cache="compiled"):
        assert "flushes" not in rec and rec["median"] > 0 and rec["kv_bytes"]["flushes"] == 0
        if rec["phase"] == "decode":
            assert rec["bytes_per_token"] > 0
    checks = {(c["a"], c["b"]): c for c in doc["checks"]}
    for w in ("full", "affine4"):
        for c in ("compiled", "compiled-split"):
            assert checks[(f"{w}/fp", f"{w}/{c}")]["identical"] is True
    pairs = {(c["baseline_arm"], c["other_arm"]) for c in doc["comparisons"]}
    assert {("full/fp", "full/compiled"), ("affine4/fp", "affine4/compiled-split")} <= pairs
    assert bench_decode.parse_args(["--source", str(tiny_source), "--out", "x.json", "--weights", "full"]).caches == \
        ["fp", "kivi-ref", "kivi-kernel"]  # the compiled caches only when asked for
