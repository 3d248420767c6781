"""bench-quality's shared source reference and window shards: exact reorganisations of the work."""

import json

import mlx.core as mx
import numpy as np

from vqpipe.stages import bench_quality as q


def test_shared_reference_metrics_match_the_direct_formula(tmp_path):
    ref = mx.random.normal((12, 300), key=mx.random.key(0)) * 3
    ref = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
    lp = ref + mx.random.normal((12, 300), key=mx.random.key(1)) * 0.5
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    tokens = mx.array(list(range(12)))
    kl, top1, nll = q.window_metrics(q.reference(ref, str(tmp_path / "r.npy")), lp, tokens)
    want = mx.mean(mx.sum(mx.exp(ref) * (ref - lp), axis=-1)).item()
    assert abs(kl - want) < 1e-5 * max(1.0, want) and kl > 0.01
    assert top1 == np.mean(np.array(mx.argmax(ref, axis=-1) == mx.argmax(lp, axis=-1)))
    assert nll == q.nll(lp, tokens)
    want = -mx.mean(mx.take_along_axis(lp[:-1], tokens[1:, None], axis=-1)).item()
    assert abs(nll - want) < 1e-6 * max(1.0, abs(want))


def test_window_shards_merge_to_the_whole_run(tiny_source, tmp_path):
    common = ["--source", str(tiny_source), "--bits", "2", "--arms", "unrotated", "affine-g64",
              "--affine-groups", "64", "--windows", "5", "--length", "16", "--gen-prompts", "1", "--gen-tokens", "2"]
    whole, parts = tmp_path / "whole.json", [tmp_path / f"s{i}.json" for i in range(2)]
    assert q.main([*common, "--out", str(whole)]) == 0
    for i, part in enumerate(parts):
        assert q.main([*common, "--shard", f"{i}/2", "--out", str(part)]) == 0
    merged = tmp_path / "merged.json"
    assert q.main(["--merge", *map(str, parts[::-1]), "--out", str(merged)]) == 0
    a, b = json.loads(whole.read_text()), json.loads(merged.read_text())
    assert json.loads(parts[1].read_text())["generations"]["arms"] == []  # shard 0 generates
    assert a["generations"] == b["generations"]
    assert b["source"]["per_window"]["index"] == list(range(5))
    for key in ("source", "records"):
        assert json.dumps(a[key], sort_keys=True) == json.dumps(b[key], sort_keys=True)
    assert q.main(["--merge", str(parts[0]), "--out", str(merged)]) == 2  # shard 1 of 2 missing
    assert q.main([*common, "--shard", "2/2", "--out", str(merged)]) == 2


def test_arm_parts_against_one_reference_merge_to_the_whole_run(tiny_source, tmp_path):
    common = ["--source", str(tiny_source), "--bits", "2", "--affine-groups", "64", "--windows", "3",
              "--length", "16", "--gen-prompts", "1", "--gen-tokens", "2"]
    whole, ref = tmp_path / "whole.json", tmp_path / "ref"
    assert q.main([*common, "--arms", "unrotated", "affine-g64", "--out", str(whole)]) == 0
    assert q.main([*common, "--reference-out", str(ref)]) == 0
    parts = [tmp_path / f"{arm}.json" for arm in ("unrotated", "affine-g64")]
    for part in parts:
        assert q.main([*common, "--reference", str(ref), "--arms", part.stem, "--no-embeddings", "--out", str(part)]) == 0
    merged = tmp_path / "merged.json"
    assert q.main(["--merge", *map(str, parts), "--out", str(merged)]) == 0
    a, b = json.loads(whole.read_text()), json.loads(merged.read_text())
    for key in ("source", "records", "generations", "windows", "length", "text"):
        assert json.dumps(a[key], sort_keys=True) == json.dumps(b[key], sort_keys=True), key
    assert "part" not in b and json.loads(parts[0].read_text())["part"] == {"bits": [2], "arms": ["unrotated"]}
    # the same arm twice, a part and a shard, another window count: refused
    assert q.main(["--merge", str(parts[0]), str(parts[0]), "--out", str(merged)]) == 2
    shard = tmp_path / "shard.json"
    assert q.main([*common, "--arms", "unrotated", "--shard", "0/2", "--out", str(shard)]) == 0
    assert q.main(["--merge", str(parts[0]), str(shard), "--out", str(merged)]) == 2
    bad = [c if c != "3" else "2" for c in common]
    assert q.main([*bad, "--reference", str(ref), "--arms", "unrotated", "--out", str(merged)]) == 2


def test_a_part_of_skipped_arms_reads_no_windows(tiny_llama_source, tmp_path):
    """tiny-llama's 1472-wide MLP rows: a g128 part is skipped from the model's shapes alone, so it
    needs only reference.json (the pipeline's skipped SmolLM2 g128 jobs: seconds, no 2 GB read);
    a measured arm of the same reference still reads and checks every window."""
    common = ["--source", str(tiny_llama_source), "--bits", "2", "--windows", "2", "--length", "16",
              "--gen-prompts", "1", "--gen-tokens", "2"]
    ref = tmp_path / "ref"
    assert q.main([*common, "--reference-out", str(ref)]) == 0
    for f in ref.rglob("*.npy"):  # every text's folder
        f.unlink()
    out = tmp_path / "g128.json"
    assert q.main([*common, "--reference", str(ref), "--arms", "affine-g128", "--no-embeddings", "--out", str(out)]) == 0
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["method"] == "affine-g128" and "1472" in rec["skipped"]
    assert q.main([*common, "--reference", str(ref), "--arms", "affine-g32", "--no-embeddings", "--out", str(out)]) == 2
