"""experiments/step_kernels.py (an Nsight Compute CSV read and summed per kernel family) and
experiments/kv_write.py (the KV-write A/B), on the CPU: the profiling itself needs the H200."""

import json

import mlx.core as mx
import pytest

from experiments import kv_write, step_kernels

NCU_CSV = """==PROF== Connected to process 123
==PROF== Profiling "custom_kernel_vqpipe_qmv3_0a1b2c3d" - 0: 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","123","python3","h","custom_kernel_vqpipe_qmv3_0a1b2c3d","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","13.80"
"1","123","python3","h","rms_norm_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","2,100"
"2","123","python3","h","custom_kernel_vqpipe_qmv3_ffeedd00","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","14.20"
"3","123","python3","h","rms_norm_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,900"
"""


def test_family_drops_the_source_digest_only():
    assert step_kernels.family("custom_kernel_vqpipe_qmv3_0a1b2c3d") == "custom_kernel_vqpipe_qmv3"
    assert step_kernels.family(" rms_norm_kernel ") == "rms_norm_kernel"
    assert step_kernels.family("copy_v_abc") == "copy_v_abc"  # not hex of 6+: kept


def test_ncu_csv_summed_per_family_and_step(tmp_path):
    path = tmp_path / "k.csv"
    path.write_text(NCU_CSV)
    rows = step_kernels.read_ncu_csv(path)
    assert [r[3] for r in rows] == pytest.approx([13.8, 2.1, 14.2, 1.9])
    s = step_kernels.summarize(rows, steps=2)
    assert s["kernels_per_step"] == 2 and s["us_per_step"] == pytest.approx(16.0)
    top, norm = s["families"]
    assert top["family"] == "custom_kernel_vqpipe_qmv3" and top["us_per_step"] == pytest.approx(14.0)
    assert top["kernels_per_step"] == 1 and top["us_per_kernel"] == pytest.approx(14.0)
    assert norm["us_per_kernel"] == pytest.approx(2.0) and norm["launch_shapes"] == ["(1, 1, 1)x(128, 1, 1)"]
    assert "16.0 µs per step" in step_kernels.table(s)
    out = tmp_path / "k.json"
    assert step_kernels.main(["--summarize", str(path), "--steps", "2", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["families"][0]["family"] == "custom_kernel_vqpipe_qmv3"


@pytest.mark.parametrize("text, message", [("==PROF== nothing profiled\n", "no Nsight Compute CSV header"),
                                           (NCU_CSV.replace('"usecond"', '"furlong"'), "unexpected unit"),
                                           (NCU_CSV.replace("gpu__time_duration.sum", "sm__cycles"), "no gpu__time")])
def test_ncu_csv_errors_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        step_kernels.read_ncu_csv(path)


def test_kv_write_arms_write_the_same_caches_on_cpu(tmp_path):
    with mx.stream(mx.cpu):
        rows = kv_write.run([8, 16], layers=2, heads=2, head_dim=4, inputs=3, repeats=3, warmup=1, dtype=mx.float32)
    assert [r["capacity"] for r in rows] == [8, 16] and all(r["same_caches"] for r in rows)
    assert all(set(r["arms"]) == set(kv_write.ARMS) and r["arms"]["scatter"]["n"] == 3 for r in rows)


def test_kv_write_scatter_writes_one_position():
    kb = mx.arange(2 * 6 * 3, dtype=mx.float32).reshape(1, 2, 6, 3)
    k = -mx.ones((1, 2, 1, 3))
    for write in (kv_write.write_slice, kv_write.write_scatter):
        out, _ = write(kb, kb, k, k, mx.array(4, mx.int32))
        assert mx.array_equal(out[:, :, 4:5], k).item()
        assert mx.array_equal(mx.concatenate([out[:, :, :4], out[:, :, 5:]], axis=2),
                              mx.concatenate([kb[:, :, :4], kb[:, :, 5:]], axis=2)).item()
