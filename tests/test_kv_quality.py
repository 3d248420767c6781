"""bench-kv-quality (vqpipe/stages/bench_kv_quality.py): cache kinds, the measured figures on a real
reservoir of the tiny model, the record and the report's first-screen section."""

import json

import pytest

from vqpipe.report import render
from vqpipe.report.summary import build_summary, read_records
from vqpipe.stages import bench_kv_quality as kvq


def test_kind_names():
    assert [kvq.kind_bits(k) for k in ("fp", "kivi4", "kivi2", "mlx-q4", "mlx-q8")] == [None, 4, 2, 4, 8]
    for bad in ("kivi3", "mlx-q", "q4", "kivi", "fp16"):
        with pytest.raises(ValueError, match="unknown cache kind"):
            kvq.kind_bits(bad)


@pytest.mark.parametrize("args,says", [
    (["--kinds", "fp", "kivi5"], "unknown cache kind 'kivi5'"),
    (["--chunk", "0"], "--chunk and --windows must be >= 1"),
    (["--model-dir", "no-such"], "--model-dir no-such is not a directory"),
])
def test_bad_arguments_name_the_problem(tmp_path, capsys, args, says):
    base = {"--model-dir": str(tmp_path), "--out": str(tmp_path / "o.json")}
    flags = [x for k, v in base.items() if k not in args for x in (k, v)]
    with pytest.raises(SystemExit) as e:
        kvq.main(flags + args)
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


@pytest.fixture(scope="module")
def record(tiny_b4_reservoir, tmp_path_factory):
    out = tmp_path_factory.mktemp("kvq") / "kv_quality.json"
    # 192 tokens: 64 beyond KIVI's 128-token window are quantized (two groups of 32)
    assert kvq.main(["--model-dir", str(tiny_b4_reservoir), "--model", "tiny", "--windows", "2", "--length", "192",
                     "--chunk", "32", "--kinds", "fp", "kivi4", "mlx-q4", "kivi2", "--out", str(out)]) == 0
    return out, json.loads(out.read_text())


def test_figures_are_measured(record):
    _, doc = record
    assert doc["stage"] == "bench-kv-quality" and doc["model"] == "tiny" and doc["loaded"] == "vqpipe reservoir"
    res, f16 = doc["results"], doc["fp16_bytes_per_token"]
    assert set(res) == {"fp", "kivi4", "mlx-q4", "kivi2"} and len(doc["windows"]) == 2
    assert res["fp"]["kl"]["max"] == 0 and res["fp"]["top1"]["min"] == 1
    # quantizing loses something, and fewer bits lose more
    assert 0 < res["kivi4"]["kl"]["median"] < res["kivi2"]["kl"]["median"]
    assert res["mlx-q4"]["kl"]["median"] > 0
    # the quantized stores are smaller than the fp cache at the run's dtype, 2 bits smaller than 4
    assert res["kivi2"]["bytes_per_token"]["median"] < res["kivi4"]["bytes_per_token"]["median"] \
        < res["fp"]["bytes_per_token"]["median"]
    assert res["mlx-q4"]["bytes_per_token"]["median"] < f16
    for w in doc["windows"]:
        assert all(w[k]["ppl"] > 1 for k in w)
    assert set(doc["paired"]) == {"kivi4 vs mlx-q4"}  # kivi2 has no mlx-q2 here
    pair = doc["paired"]["kivi4 vs mlx-q4"]
    ratios = sorted(w["mlx-q4"]["kl"] / w["kivi4"]["kl"] for w in doc["windows"])
    assert pair["kl_ratio"]["median"] == pytest.approx(sum(ratios) / 2)
    assert pair["kivi_lower_kl"] == sum(r > 1 for r in ratios) and pair["windows"] == 2


def test_report_leads_with_it(record):
    path, doc = record
    arts, passed_over = read_records([path])
    summary = build_summary(arts, passed_over)
    assert summary["kv_quality"]["tiny"]["length"] == 192
    blocks = render.document(summary).blocks
    first = next(i for i, b in enumerate(blocks[1:], 1) if b["type"] == "h" and b["level"] == 2
                 and b["text"] != "Summary")  # the summary's end
    head = "\n".join(b.get("text", "") + " ".join(map(str, b.get("rows", []))) for b in blocks[:first])
    assert "tiny: KV cache memory and quality" in head
    assert "Verdict on the KV cache: KIVI-4 holds" in head and "; KIVI-2 holds" in head  # the config's order
    assert "mlx-lm's 4-bit QuantizedKVCache" in head
    assert f"{doc['results']['kivi4']['kl']['median']:.3g}" in head
