import json
import math
import os
import subprocess
import sys
import time

import mlx.core as mx
import mlx.nn as nn
import pytest

from vqpipe import blas, numerics
from vqpipe.bench import (
    AA_SUFFIX,
    NO_DIFFERENCE,
    aa_floor,
    compare,
    compare_all,
    environment,
    measure_peak,
    noise_floor,
    peak_per_arm,
    run_interleaved,
    summarize,
    with_aa,
)
from vqpipe.bench import roofline as rl


def test_interleaved_order_rotation_and_warmup():
    calls = []

    def arm(name):
        def fn(i):
            calls.append((name, i))
            return mx.array(i)

        return fn

    times = run_interleaved({"A": arm("A"), "B": arm("B")}, n_inputs=3, repeats=4, warmup=2)
    assert calls == [(n, i) for i in (0, 1, 2, 0, 1, 2) for n in "AB"]
    assert list(times) == ["A", "B"] and all(len(t) == 4 for t in times.values())


def test_warmup_is_not_timed():
    seen = []

    def slow_first(i):
        seen.append(i)
        if len(seen) == 1:
            time.sleep(0.2)
        return mx.array(0)

    times = run_interleaved({"x": slow_first}, n_inputs=1, repeats=3, warmup=1)["x"]
    assert len(seen) == 4 and max(times) < 0.1
    times = run_interleaved({"x": lambda i: time.sleep(0.05)}, n_inputs=1, repeats=2, warmup=0)["x"]
    assert min(times) >= 0.05


def test_timing_includes_evaluation():
    # MLX is lazy: an arm returns an unevaluated graph; the harness must time its evaluation too.
    x = mx.random.normal((1 << 17,))
    mx.eval(x)

    def arm(i):
        y = x
        for _ in range(10):
            y = mx.exp(mx.sin(y))
        return y

    t0 = time.perf_counter()
    arm(0)
    build = time.perf_counter() - t0
    t = run_interleaved({"x": arm}, n_inputs=1, repeats=3, warmup=1)["x"]
    assert min(t) > 5 * build


def test_bad_arguments():
    with pytest.raises(ValueError):
        run_interleaved({}, 1, 1, 0)
    with pytest.raises(ValueError):
        run_interleaved({"a": lambda i: None}, 0, 1, 0)
    with pytest.raises(ValueError):
        summarize([])


def test_summarize():
    assert summarize([3.0, 1.0, 2.0, 10.0]) == {"n": 4, "median": 2.5, "min": 1.0, "max": 10.0}
    assert summarize([7]) == {"n": 1, "median": 7, "min": 7, "max": 7}


def test_noise_floor_definition():
    assert noise_floor([1.0] * 5, [1.0] * 5) == 0.0
    assert noise_floor([1.1] * 5, [1.0] * 5) == pytest.approx(0.1)  # pure drift
    a = [1.0, 1.1, 0.9, 1.0, 1.0]  # median 1, MAD 0
    b = [1.0, 1.2, 0.8, 1.1, 0.9]  # median 1, MAD 0.1
    se_b = 1.2533 * 1.4826 * 0.1 / math.sqrt(5)
    assert noise_floor(a, b) == pytest.approx(2 * se_b)  # sampling term dominates


def test_aa_pair_inside_its_own_floor_whichever_is_slower():
    # The drift term is taken larger over smaller: with |a/a2 - 1| a slower second copy fell outside
    # (1.0 vs 1.1: floor 0.0909, ratio 1.1), which made the live A/A test below flaky.
    for a, a2 in (([1.0] * 5, [1.1] * 5), ([1.1] * 5, [1.0] * 5), ([3.0, 3.1, 2.9], [1.7, 1.71, 1.69])):
        assert compare(a, a2, noise_floor(a, a2))["verdict"] == NO_DIFFERENCE


def test_verdicts():
    base = [1.0, 1.01, 0.99]
    assert compare(base, [0.5, 0.49, 0.51], 0.05)["verdict"] == "2.00x faster"
    assert compare(base, [1.5, 1.52, 1.49], 0.05)["verdict"] == "1.50x slower"
    c = compare(base, [1.02, 1.03, 1.01], 0.05)
    assert c["verdict"] == NO_DIFFERENCE and c["speedup"] == pytest.approx(1 / 1.02)
    assert compare(base, [0.96], 0.05)["verdict"] == NO_DIFFERENCE
    assert compare(base, [0.94], 0.05)["verdict"] != NO_DIFFERENCE
    assert "±5.0%" in c["text"] and c["baseline"]["n"] == 3 and c["floor"] == 0.05


def test_live_run_finds_a_real_difference_beyond_its_aa_floor():
    # An A/A pair always sits inside its own floor (by construction, tested above), so the live
    # check is the other way round: an arm doing 32x the work must come out slower, beyond the floor.
    # (At 4x the work a floor of +-300 %, seen at load 13 on 2 cores, swallowed the difference.)
    y = mx.random.normal((256, 256)) / 16  # unit-scale products: no overflow along the chain

    def chain(n):
        z = y
        for _ in range(n):
            z = z @ y
        return z

    arms = with_aa({"base": lambda i: y @ y, "other": lambda i: chain(32)}, "base")
    assert list(arms) == ["base", "other", "base" + AA_SUFFIX]
    times = run_interleaved(arms, n_inputs=2, repeats=5, warmup=1)
    floor = aa_floor(times, "base")
    comps = compare_all(times, "base")
    assert list(comps) == ["other"] and comps["other"]["floor"] == floor
    assert comps["other"]["verdict"].endswith("slower"), comps["other"]["text"]
    assert comps["other"]["ratio"] > 1 + floor


def test_peak_memory_tracks_allocation_size():
    small = measure_peak(lambda: mx.zeros((1 << 18,)))  # 1 MiB
    big = measure_peak(lambda: mx.zeros((1 << 22,)))  # 16 MiB
    again = measure_peak(lambda: mx.zeros((1 << 18,)))  # reset: not the previous arm's peak
    assert big - small >= 15 * 2**20
    assert again < big
    peaks = peak_per_arm({"s": lambda i: mx.ones((1 << 18,)), "b": lambda i: mx.ones((1 << 22,))})
    assert peaks["b"] - peaks["s"] >= 15 * 2**20


def test_environment():
    env = environment()
    for key in ("backend", "device", "metal", "cuda", "gpu_name", "cpu_model", "blas", "versions", "platform"):
        assert key in env
    assert env["backend"] in ("cpu", "gpu")
    assert env["versions"]["mlx"] == mx.__version__ and env["versions"]["numpy"]
    assert env["blas"]["name"] and env["blas"]["name"] != "unknown"
    json.dumps(env)


def test_blas_detection_in_this_process():
    info = blas.in_use()
    if sys.platform == "darwin":
        assert info["name"] == "accelerate"
        return
    assert os.path.exists(info["path"])
    assert info["name"] == ("openblas" if blas.preloaded() == "openblas" else "reference")


def test_blas_policy_and_env():
    assert blas.choice({"VQPIPE_BLAS": "reference"}) in ("reference", "accelerate")
    with pytest.raises(ValueError):
        blas.choice({"VQPIPE_BLAS": "mkl"})
    libs = blas.openblas_libs()
    env = blas.env_for("openblas", {"LD_PRELOAD": "/x/other.so"})
    assert env["LD_PRELOAD"].split(":") == [*libs, "/x/other.so"] and blas.preloaded(env) == "openblas"
    env = blas.env_for("reference", env)
    assert env["LD_PRELOAD"] == "/x/other.so" and env["VQPIPE_BLAS"] == "reference"
    assert "LD_PRELOAD" not in blas.env_for("reference", {"LD_PRELOAD": ":".join(libs)})
    environ = {"LD_PRELOAD": ":".join(libs), "PATH": "/bin"}
    blas.apply("reference", environ)
    assert "LD_PRELOAD" not in environ and environ["VQPIPE_BLAS"] == "reference"
    blas.prepend_path("/venv/bin", environ)
    assert environ["PATH"] == f"/venv/bin{os.pathsep}/bin"


def test_avx512_machines_get_width_invariant_kernels(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl\n")
    assert blas._has_avx512(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f\n")
    assert not blas._has_avx512(str(info)) and not blas._has_avx512(str(tmp_path / "missing"))
    monkeypatch.setattr(blas, "_has_avx512", lambda: True)
    assert blas.env_for("reference", {})["OPENBLAS_CORETYPE"] == blas.AVX512_CORE
    assert blas.env_for("openblas", {"OPENBLAS_CORETYPE": "Haswell"})["OPENBLAS_CORETYPE"] == "Haswell"
    monkeypatch.setattr(blas, "_has_avx512", lambda: False)
    assert "OPENBLAS_CORETYPE" not in blas.env_for("reference", {})


def test_numeric_setup_is_one_definition():
    one, two = ({"backend": "cpu", "device": "cpu", "blas": {"name": "openblas", "threads": t},
                 "versions": {"mlx": "0.32.4"}} for t in (1, 2))
    assert numerics.differences(one, dict(one)) == []
    assert numerics.differences(one, two) == ["blas.threads: 1 (reference) != 2 (here)"]
    assert numerics.key(two) == "cpu/openblas(2 threads), mlx 0.32.4"
    with pytest.raises(ValueError, match="blas.threads"):
        numerics.require_same(one, two)
    numerics.require_same(one, dict(one))


def _child(env, code="import vqpipe.blas as b; import mlx.core; print(b.in_use()['name'])"):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)


@pytest.mark.skipif(not blas.openblas_available(), reason="Debian OpenBLAS not installed")
def test_blas_is_decided_by_the_environment_a_process_starts_in():
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VQPIPE_BLAS")}
    assert _child(blas.env_for("openblas", base)).stdout.strip() == "openblas"
    assert _child(blas.env_for("reference", base)).stdout.strip() == "reference"
    # A library process does not re-execute: the policy alone does not change its BLAS. The vqpipe
    # command starts again under the policy's environment instead, silently (tests/test_cli.py).
    assert _child({**base, "VQPIPE_BLAS": "openblas"}).stdout.strip() == "reference"
    cli = subprocess.run([sys.executable, "-m", "vqpipe", "inspect", "--help"], env={**base, "VQPIPE_BLAS": "auto"},
                         capture_output=True, text=True, check=True)
    assert "warning" not in cli.stderr and cli.stdout.startswith("usage: vqpipe inspect")
    # --env / --exports give a shell the policy's setup
    words = _child(base, "import vqpipe.blas as b; b.main(['--env'])").stdout.split()
    env = dict(w.split("=", 1) for w in words)
    assert env["VQPIPE_BLAS"] == "openblas" and blas.preloaded(env) == "openblas"
    assert _child({**base, **env}).stdout.strip() == "openblas"


def test_roofline_arithmetic():
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    assert rl.kv_bytes_per_position(cfg) == 2 * 2 * 2 * 16 * 4
    assert rl.kv_bytes_per_position(cfg, bytes_per_element=2) == 2 * 2 * 2 * 16 * 2
    assert rl.decode_bytes_per_token(1000, 512, 10) == 6120
    assert rl.flops_per_token(100) == 200
    assert rl.flops_per_token(100, cfg, context=8) == 200 + 4 * 2 * 4 * 16 * 8
    a = rl.achieved(1e6, 50.0, 1e9)
    assert a["bytes_per_s"] == 5e7 and a["percent_of_peak"] == pytest.approx(5.0)


class _Tiny(nn.Module):
    def __init__(self, tied):
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 32)
        self.layers = [nn.Linear(32, 32, bias=False)]
        if not tied:
            self.lm_head = nn.Linear(32, 100, bias=False)


def test_weight_bytes_and_params():
    tied, untied = _Tiny(True), _Tiny(False)
    assert rl.weight_bytes_read(tied) == (3200 + 1024) * 4
    assert rl.weight_bytes_read(untied) == (32 + 1024 + 3200) * 4  # one embedding row is read
    assert rl.matmul_params(tied) == 4224 and rl.matmul_params(untied) == 4224
    q = _Tiny(False)
    nn.quantize(q, group_size=32, bits=4)
    assert rl.weight_bytes_read(q) < rl.weight_bytes_read(untied)
    with pytest.raises(ValueError):
        rl.matmul_params(q)


def test_measurements_are_sane():
    bw = rl.measure_copy_bandwidth(nbytes=64 << 20, repeats=3, warmup=1)
    assert bw["n"] == 3 and bw["min"] <= bw["median"] <= bw["max"] and 1e8 < bw["median"] < 1e13
    fl = rl.matmul_flops(128, 128, 128, repeats=3)
    assert fl["n"] == 3 and fl["median"] > 1e7
