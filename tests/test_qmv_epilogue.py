"""The residual add in the mat-vec epilogue (vqpipe/qmv.py ``epilogue_code``; revisions 6 and 8) and
its use in decode_step's split mode (``Decoder(epilogue=True)``: o_proj and down_proj).

The fused form stores T(h + W.x) where the unfused step stores T(h + T(W.x)): in bf16/fp16 one
rounding of W.x fewer, in float32 the same bits (the cast of a float32 sum to float32 is exact, so
both are fl32(h + fl32(W.x))).

CPU: the rendered kernels (the addend read once per output, after any split-K reduction), their
compilation for sm_90 with nvcc where it is installed, the argument rule, and the split step's
wiring: with the launch replaced by the dense path (which the CPU can run), every layer's o_proj and
down_proj get the residual and the greedy tokens equal mlx-lm's eager decode. GPU: the kernels
against float64 within the float32 accumulation bound of tests/test_qmv.py plus one cast, M = 1..8,
split K and not, bf16/fp16/float32; the compiled step with 2 Add primitives fewer per layer and, in
float32, the same logits bit for bit.
"""

import re
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from vqpipe import bitpack, qmv, qmv_tc
from vqpipe.decode_step import Decoder
from vqpipe.qlinear import dense_forward
from vqpipe.quantize import quantize_model
from vqpipe.stages.bench_decode import generate_once, make_cache

from test_qmv import _EPS, _weights

MINIFIED_EPILOGUES = {"rev6": 2, "rev8": 1}  # QMV_EPILOGUE sites: rev 6's KS = 1 and KS > 1 paths; rev 8's one


def _bodies(residual):
    return {"rev6": qmv.render("cuda", 1, residual)[2], "rev8": qmv_tc.render(1, residual=residual)[2]}


def test_rendered_epilogue_reads_the_residual_once_per_output():
    plain, fused = _bodies(False), _bodies(True)
    for rev, sites in MINIFIED_EPILOGUES.items():
        assert "residual" not in plain[rev]
        assert fused[rev].count("residual[m * OUT + o]") == sites
        # added to the float32 sum after the bias, before the one cast to T
        assert re.search(r"s_ \+= static_cast<float>\(bias\[o\]\); \} s_ \+= static_cast<float>\(residual\[m \* OUT \+ o\]\); "
                         r"const T v = static_cast<T>\(s_\);", fused[rev])
    # rev 8's epilogue sits under `if (ks == 0u)`, after the partials of all KS warps are summed
    tc = fused["rev8"]
    assert tc.index("if (ks == 0u) {\n#pragma unroll") < tc.index("residual[")
    assert tc.rindex("tot[i] += red_s") < tc.index("residual[")
    names = {qmv.render("cuda", 1, r)[0] for r in (False, True)} | {qmv_tc.render(1, residual=r)[0] for r in (False, True)}
    assert len(names) == 4  # MLX caches kernels by name
    with pytest.raises(ValueError, match="one output"):
        qmv.epilogue_code(3, residual=True)


def test_residual_fits_only_the_exact_output():
    x = mx.zeros((1, 1, 64), mx.bfloat16)
    assert qmv.residual_fits(mx.zeros((1, 1, 32), mx.bfloat16), x, 32)
    assert not qmv.residual_fits(mx.zeros((1, 1, 32), mx.float32), x, 32)  # would promote
    assert not qmv.residual_fits(mx.zeros((32,), mx.bfloat16), x, 32)  # would broadcast
    assert not qmv.residual_fits(mx.zeros((1, 1, 32), mx.bfloat16), x, 32, splits=(16,))


def _nvcc(src):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as t:
        (Path(t) / "k.cu").write_text(src)
        r = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-std=c++17", "-Xptxas", "-v", "k.cu", "-o", "k.cubin"],
                           cwd=t, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return int(re.search(r"Used (\d+) registers", r.stderr).group(1))


def _template(spec):
    return [(k, v if isinstance(v, int) else str(v).rsplit(".", 1)[-1]) for k, v in spec["template"]]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
def test_residual_kernels_compile_for_sm90(dt):
    # MLX's generated translation unit (experiments/cuda_time.py) through nvcc's ptxas: the residual
    # kernels compile, with no more registers than the plain ones (the addend is one load per output)
    from experiments import cuda_time as ct

    regs = {}
    for res in (False, True):
        spec = qmv.launch_spec((1, 1, 4096), (4096, 512), (4096,), 16, None, 4, getattr(mx, dt))
        name, header, body = qmv.render("cuda", 1, res)
        ins = [("x", dt, 3), ("packed", "uint32", 2), ("scales", "float32", 1), ("codebook", "float32", 1), ("bias", dt, 2),
               ("rot_s", "float32", 2), ("rot_l", "float32", 2), ("seg", "int32", 1)] + ([("residual", dt, 3)] if res else [])
        regs["rev6", res] = _nvcc(ct.kernel_source(name, header, body, ins, [("out0", dt)], _template(spec)))
        if dt == "bfloat16":
            spec = qmv_tc.launch_spec((1, 1, 4096), 4096, (4096,), None, mx.bfloat16)
            name, header, body = qmv_tc.render(1, residual=res)
            ins = [("x", dt, 3), ("packed", "uint32", 1), ("scales", "float32", 1), ("codebook", "float32", 1),
                   ("bias", dt, 2), ("seg", "int32", 1)] + ([("residual", dt, 3)] if res else [])
            regs["rev8", res] = _nvcc(ct.kernel_source(name, header, body, ins, [("out0", dt)], _template(spec)))
    for rev in {r for r, _ in regs}:
        assert regs[rev, True] <= regs[rev, False] + 2, regs


def _prompts():
    return [mx.random.randint(0, 8192 - 16, (n,), key=mx.random.key(40 + n)) for n in (1, 5, 23)]


@pytest.fixture(scope="module")
def tiny_llama_vq4(tiny_llama_source):
    model, _ = load(str(tiny_llama_source))
    quantize_model(model, 4, embeddings=True, dtype=mx.float32)
    return model


def _dense_launch(calls):
    """qmv.launch computed by the dense path (runs on the CPU), recording which calls carry a residual."""
    def launch(dialect, x, packed, scales, codebook, bits, bias=None, group_size=None, rotation=None, splits=None,
               owner=None, residual=None):
        calls.append(residual is not None)
        xr = x if rotation is None else rotation.apply(x)
        y = dense_forward(xr, packed, scales, codebook, bits, bias, group_size)
        if splits is not None:
            return mx.split(y, splits, axis=-1)
        return y if residual is None else residual + y
    return launch


def test_split_step_epilogue_wiring_and_tokens_on_cpu(tiny_llama_vq4, monkeypatch):
    model = tiny_llama_vq4
    refs = [generate_once(model, p, make_cache(model, "fp", 4, 32, 0), 10, 8)["ids"] for p in _prompts()]
    calls = []
    monkeypatch.setattr(qmv, "dispatch", lambda x: "cuda" if 0 < qmv.rows_of(x) <= qmv.MAX_M else None)
    monkeypatch.setattr(qmv, "launch", _dense_launch(calls))
    for epilogue in (False, True):
        calls.clear()
        dec = Decoder(model, 48, "split", epilogue=epilogue)
        assert dec.epilogue is epilogue
        for prompt, ref in zip(_prompts(), refs):
            assert dec.generate(prompt, 10, prefill_step=8)["ids"] == ref
        # traced once per block: o_proj and down_proj of every layer take the residual, nothing else does
        assert sum(calls) == (2 * len(model.layers) if epilogue else 0)
    assert not Decoder(model, 48, "whole", epilogue=True).epilogue  # split mode only


def test_epilogue_switch_defaults_off(tiny_llama_vq4, monkeypatch):
    import os

    assert qmv.EPILOGUE == (os.environ.get("VQPIPE_QMV_EPILOGUE", "0") == "1")
    for flag in (False, True):
        monkeypatch.setattr(qmv, "EPILOGUE", flag)
        assert Decoder(tiny_llama_vq4, 8, "split").epilogue is flag


# --- GPU ---------------------------------------------------------------------------------------------------

def _gpu():
    return qmv.backend() == "cuda"


def _reference64(x, packed, scales, levels, bias, r, bits, tc=False):
    """(y, tolerance) in float64 for T(r + s * (W.x) + b): the float32 accumulation bound of
    tests/test_qmv.py (rev 8: tests/test_qmv_tc.py's, with the hi + lo residual), one more float32 add
    (of r), then ONE cast to T (half an ulp of |y|): the unfused T(r + T(W.x)) would need two."""
    n = x.shape[-1]
    xd = np.array(x.astype(mx.float32), dtype=np.float64).reshape(-1, n)
    w = levels.astype(np.float64)[bitpack.unpack_numpy(packed, bits, n)]
    s = scales.astype(np.float64)
    acc = xd @ w.T
    b = 0.0 if bias is None else np.array(bias.astype(mx.float32), dtype=np.float64)
    rd = np.array(r.astype(mx.float32), dtype=np.float64).reshape(acc.shape)
    y = acc * s + b + rd
    mag = s * (np.abs(xd) @ np.abs(w).T)
    err32 = (n + 48) * 2.0**-24 * mag + 2.0**-23 * (np.abs(acc * s) + np.abs(b) + np.abs(y))
    if tc:
        err32 = err32 + 2.0**-16 * mag
    dt = str(x.dtype).rsplit(".", 1)[-1]
    return y, err32 + _EPS[dt] / 2 * (np.abs(y) + err32) + (2.0**-24 if dt == "float16" else 1e-37)


def _check(got, y, tol):
    g = np.array(got.astype(mx.float32), dtype=np.float64).reshape(y.shape)
    excess = np.abs(g - y) / tol
    assert np.isfinite(g).all()
    assert excess.max() <= 1, f"error {excess.max():.2f}x the bound"


# (bits, dtype, in, out, M, bias): split K (KS = 2, 4) and KS = 1 (many rows or short ones), see the test below
REV6 = [(4, "bfloat16", 4096, 4096, 1, False), (4, "bfloat16", 14336, 64, 1, True), (4, "float16", 4096, 64, 3, True),
        (4, "float32", 896, 4096, 8, False), (3, "bfloat16", 4096, 576, 2, True), (2, "float16", 4864, 896, 5, False),
        (4, "float32", 4096, 64, 6, True), (4, "bfloat16", 4096, 32768, 1, False), (4, "float16", 256, 20000, 4, True)]
# (in, out, M): KS = 8 (split K) where in > 256, else KS = 1
REV8 = [(4096, 4096, 1), (14336, 64, 1), (4096, 64, 2), (128, 4096, 3), (1024, 320, 7), (4096, 64, 8), (256, 65536, 1)]


def _ks6(cfg):
    bits, dt, n_in, n_out, m, _ = cfg
    return qmv.launch_spec((1, m, n_in), (n_out, bitpack.words_per_row(n_in, bits)), (n_out,), 1 << bits, None, bits,
                           getattr(mx, dt))["threadgroup"][1]


def _ks8(n_in, n_out, m):
    return qmv_tc.launch_spec((1, m, n_in), n_out, (n_out,), None, mx.bfloat16)["threadgroup"][1]


def test_gpu_cases_cover_both_reductions_and_every_dtype():
    # the epilogue sits in two places in rev 6 (KS = 1 and after the split-K partials): both run per dtype
    for dt in ("bfloat16", "float16", "float32"):
        assert {_ks6(c) > 1 for c in REV6 if c[1] == dt} == {True, False}, dt
    assert {_ks8(*c) > 1 for c in REV8} == {True, False}
    assert all((_ks8(*c) > 1) == (c[0] > 256) for c in REV8)
    assert {c[4] for c in REV6} | {c[2] for c in REV8} == set(range(1, 9))


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("cfg", REV6, ids=lambda c: "-".join(map(str, c)))
def test_gpu_rev6_residual_against_float64(cfg):
    bits, dt, n_in, n_out, m, with_bias = cfg
    packed, scales, levels, bias = _weights(bits, n_in, n_out)
    x = mx.random.normal((1, m, n_in), key=mx.random.key(n_out + m)).astype(getattr(mx, dt))
    r = (mx.random.normal((1, m, n_out), key=mx.random.key(7)) * 4).astype(getattr(mx, dt))
    b = mx.array(bias).astype(getattr(mx, dt)) if with_bias else None
    with qmv_tc.mode("0"):
        got = qmv.launch("cuda", x, mx.array(packed), mx.array(scales), mx.array(levels), bits, b, residual=r)
        plain = qmv.launch("cuda", x, mx.array(packed), mx.array(scales), mx.array(levels), bits, b)
    assert got.shape == (1, m, n_out) and got.dtype == x.dtype
    _check(got, *_reference64(x, packed, scales, levels, b, r, bits))
    if dt == "float32":  # the same bits as the unfused add
        assert mx.array_equal(got, r + plain).item()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("n_in,n_out,m", REV8)
def test_gpu_rev8_residual_against_float64(n_in, n_out, m):
    packed, scales, levels, bias = _weights(4, n_in, n_out)
    x = mx.random.normal((1, m, n_in), key=mx.random.key(n_out + m)).astype(mx.bfloat16)
    r = (mx.random.normal((1, m, n_out), key=mx.random.key(8)) * 4).astype(mx.bfloat16)
    b = mx.array(bias).astype(mx.bfloat16) if m % 2 else None
    rp = qmv_tc.repack(mx.array(packed))
    got = qmv_tc.launch(x, rp, n_out, mx.array(scales), mx.array(levels), b, residual=r)
    assert got.shape == (1, m, n_out) and got.dtype == mx.bfloat16
    _check(got, *_reference64(x, packed, scales, levels, b, r, 4, tc=True))


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs MLX's CUDA backend")
def test_gpu_split_step_two_adds_fewer_per_layer_same_logits(tiny_llama_vq4):
    from experiments.decode_shapes import graph_ops

    model = tiny_llama_vq4  # float32: the fused form is bit-identical to the kernel + add
    prompt = _prompts()[2]
    with qmv.enabled(True):
        runs = {}
        for epilogue in (False, True):
            dec = Decoder(model, 48, "split", epilogue=epilogue)
            token, pos, state = dec.start(prompt, 8)
            logits = []
            for _ in range(6):
                token, pos, state, lg = dec.step(token, pos, state)
                logits.append(lg)
            mx.eval(token, pos, state, logits)  # else the counted graph holds all seven steps, not one
            ops = graph_ops(dec.step(token, pos, state)[0])
            mx.eval(logits)
            runs[epilogue] = (ops, logits)
    (off, lo), (on, ln) = runs[False], runs[True]
    layers = len(model.layers)
    assert off["by_primitive"].get("Add", 0) - on["by_primitive"].get("Add", 0) == 2 * layers
    assert off["ops"] - on["ops"] == 2 * layers
    assert on["by_primitive"].get("CustomKernel", 0) == off["by_primitive"].get("CustomKernel", 0)
    assert all(mx.array_equal(a, b).item() for a, b in zip(lo, ln))
