"""experiments.step_attribution: interleaved pipelined decode and host times on the CPU; the spin kernel's GPU
timing on CUDA only."""

import json
import time

import mlx.core as mx
import pytest

from experiments import step_attribution as sa


def test_runs_on_cpu(tmp_path):
    out = tmp_path / "a.json"
    with mx.stream(mx.cpu):
        assert sa.main(["--preset", "tiny-llama", "--out", str(out), "--arms", "bf16", "vqpipe-b2", "--modes", "split",
                        "whole", "--context", "12", "--rounds", "2", "--tokens", "3"]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["arms"]) == {"bf16+s", "bf16+c", "vqpipe-b2+s", "vqpipe-b2+c"}
    for name, a in doc["arms"].items():
        assert a["decode_tok_s"]["n"] == 2 and a["decode_tok_s"]["median"] > 0
        p = a["pipelined"]
        assert p["steps"] == 3 and 0 < p["host_s"]["median"] and p["wall_per_token_s"] > 0
        assert "skipped" in a["gpu"] and a["profile"]["ops"] > 0
    assert doc["noise_floor"] > 0 and "vs_bf16+s" in doc["arms"]["vqpipe-b2+s"]


@pytest.mark.gpu
def test_spin_kernel_holds_the_gpu():
    if not sa.on_cuda():
        pytest.skip("needs CUDA")
    mx.eval(sa.spin(30.0))  # compiled: the duration is a template argument, so each value is its own kernel
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(sa.spin(30.0))
    dt = time.perf_counter() - t0
    assert 0.029 < dt < 0.2


def test_decode_shapes_attribution_flag(tmp_path):
    from experiments import decode_shapes

    out = tmp_path / "d.json"
    with mx.stream(mx.cpu):
        assert decode_shapes.main(["--preset", "tiny-llama", "--out", str(out), "--bits", "2", "--split", "--attribution",
                                   "--profile-only", "--prompt-lengths", "12", "--copy-mib", "8"]) == 0
    prof = json.loads(out.read_text())["step_profile"]
    assert all("pipelined" in prof[a] and "skipped" in prof[a]["gpu"] for a in ("bf16+s", "affine4+s", "vqpipe-b2+s"))
    assert "pipelined" not in prof["vqpipe-b2"]  # eager arms: no compiled step to attribute
