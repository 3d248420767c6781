"""The reservoir fuzz campaign in small (CI), and the runner's crash and hang detection.

The full campaign (100 000 cases) is scripts/fuzz.py reservoir; figures in docs/reliability.md.
"""

import os
import random
import sys
import textwrap

import pytest

from experiments import fuzz
from experiments import fuzz_reservoir as F
from vqpipe.store import reservoir as R


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """The campaign's base reservoirs, built once (each prepare quantizes and loads them all);
    tests read them and write their own files under tmp_path."""
    return F.prepare(tmp_path_factory.mktemp("fuzz-bases"))


def test_reservoir_campaign_ci(tmp_path):
    """3000 cases (the full campaign's first seed-7 cases) in worker processes: every outcome is
    a rejection, an identical model or a faithful load of a forged file."""
    summary = fuzz.campaign("experiments.fuzz_reservoir", 7, 3000, tmp_path, batch=1500, timeout=120)
    assert summary["cases"] == 3000
    assert summary["failed"] == 0, summary["failures"][:10]
    counts = summary["counts"]
    # The mix is what the campaign is for: most files rejected, some loading (identical or forged).
    assert counts["rejected"] > 1500 and counts["harmless"] > 100 and counts["as-described"] > 50, counts


def test_cases_are_reproducible(ctx):
    a = [F.mutate(random.Random(f"vqres:3:{i}"), ctx["bases"]) for i in range(50)]
    b = [F.mutate(random.Random(f"vqres:3:{i}"), ctx["bases"]) for i in range(50)]
    assert [(x[0].name, x[1], x[3]) for x in a] == [(x[0].name, x[1], x[3]) for x in b]
    assert len({x[1] for x in a}) > 40  # and they differ from each other


def test_oracle_catches_a_wrong_model(ctx, tmp_path, monkeypatch):
    """A reader that silently drops a param would be counted as a failure, not as harmless."""
    base = ctx["bases"][0]
    path = tmp_path / "forged" / R.FILE_NAME
    path.parent.mkdir()
    data, _ = F.m_blob_forge(random.Random(0), base, bytearray(base.data))
    path.write_bytes(bytes(data))
    assert F.classify(path, bytes(data), base, forged=True)[0] in ("as-described", "harmless")
    # Damage that "loads" different logits is a wrong model; so is an unfaithful forged load.
    assert F.classify(path, bytes(data), base, forged=False)[0] in ("wrong-model", "harmless")
    real = R._reader

    def lying_reader(p, header, prefault=None):
        read, close = real(p, header, prefault)
        return (lambda spec: read(spec) + 1 if spec["dtype"] == "float32" else read(spec)), close

    monkeypatch.setattr(R, "_reader", lying_reader)
    outcome, why = F.classify(base_path(ctx, base), base.data, base, forged=True)
    assert outcome == "wrong-model", (outcome, why)


def base_path(ctx, base):
    return ctx["path"].parent.parent / f"base-{base.name}.vqres"


CRASHY = textwrap.dedent("""
    import os, time
    def prepare(workdir):
        return None
    def run_case(ctx, seed, i):
        if i == 3:
            os.abort()
        if i == 5:
            time.sleep(60)
        if i == 7:
            raise MemoryError("too big")
        return ("rejected" if i % 2 else "harmless"), ""
""")


def test_runner_counts_crashes_and_hangs(tmp_path, monkeypatch):
    (tmp_path / "crashy_target.py").write_text(CRASHY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    summary = fuzz.campaign("crashy_target", 0, 10, tmp_path / "w", batch=10, timeout=3)
    assert summary["cases"] == 10
    assert summary["counts"] == {"crash": 1, "hang": 1, "other": 1, "harmless": 5, "rejected": 2}
    assert [(f["case"], f["outcome"]) for f in summary["failures"]] == [(3, "crash"), (5, "hang"), (7, "other")]
    assert summary["failed"] == 3


@pytest.mark.parametrize("edit, pattern", [
    (lambda h: h["config"].update(num_hidden_layers=10**6), "num_hidden_layers"),
    (lambda h: h["config"].update(model_type="../x"), "model_type"),
    (lambda h: h["config"].update(model_file="evil.py"), "model_file"),
    (lambda h: h["config"].pop("vocab_size"), "embedded config does not build"),
    (lambda h: h["config"].update(num_attention_heads=2**40), "out of bounds"),
])
def test_embedded_config_is_validated(ctx, tmp_path, edit, pattern):
    base = ctx["bases"][0]
    import copy

    header = copy.deepcopy(base.header)
    edit(header)
    path = tmp_path / "cfg" / R.FILE_NAME
    path.parent.mkdir()
    path.write_bytes(bytes(F.assemble(header, base.data[base.data_offset:], base.data_offset)))
    with pytest.raises(R.ReservoirError, match=pattern):
        R.load_reservoir(path)


@pytest.mark.parametrize("edit, pattern", [
    (lambda h: first(h, "packed").update(dtype=["uint32"]), "unknown dtype"),
    (lambda h: first(h, "scales").update(shape=[0] * 9), "invalid shape"),
    (lambda h: first(h, "scales").update(shape=[2**40, 0]), "invalid shape"),
])
def test_tensor_specs_are_bounded(ctx, tmp_path, edit, pattern):
    base = ctx["bases"][0]
    import copy

    header = copy.deepcopy(base.header)
    edit(header)
    path = tmp_path / "spec" / R.FILE_NAME
    path.parent.mkdir()
    path.write_bytes(bytes(F.assemble(header, base.data[base.data_offset:], base.data_offset)))
    with pytest.raises(R.ReservoirError, match=pattern):
        R.load_reservoir(path)


def first(header, key):
    return next(iter(header["layers"].values()))["tensors"][key]


def test_gguf_campaign_ci(tmp_path):
    """1000 mutated GGUF files converted in worker processes: each rejected with an error naming
    the file, or converted; no crash (a native parser reached with a bad file), hang or other error."""
    pytest.importorskip("gguf")
    summary = fuzz.campaign("experiments.fuzz_gguf", 7, 1000, tmp_path, batch=1000, timeout=120)
    assert summary["cases"] == 1000
    assert summary["failed"] == 0, summary["failures"][:10]
    assert summary["counts"]["rejected"] > 500 and summary["counts"]["converted"] > 50, summary["counts"]


def test_gguf_structure_is_checked_before_native_code(tmp_path, monkeypatch):
    """A tensor whose data would lie past the end of the file never reaches mx.load."""
    pytest.importorskip("gguf")
    import struct

    import mlx.core as mx

    from experiments import fuzz_gguf as G
    from vqpipe.stages.download import fetch

    ctx = G.prepare(tmp_path / "w")
    version, kvs, tensors, data = ctx["parts"]
    tensors = [list(t) for t in tensors]
    tensors[-1][3] += 1 << 40
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(G.serialize(version, kvs, tensors, data))
    calls = []
    monkeypatch.setattr(mx, "load", lambda *a, **k: calls.append(a))
    with pytest.raises(ValueError, match="bad.gguf.*run past the end"):
        fetch(f"gguf:{bad}", tmp_path / "out")
    assert calls == []
    huge = bytearray(ctx["bytes"])
    struct.pack_into("<Q", huge, 16, 2**60)  # metadata count
    bad.write_bytes(bytes(huge))
    with pytest.raises(ValueError, match="cannot fit"):
        fetch(f"gguf:{bad}", tmp_path / "out")
