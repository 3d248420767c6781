"""Fused codebook mat-vec (vqpipe/kernels/qmv.py): dialects, dispatch and validation (CPU); the kernel
against a float64 reference, determinism, layers, generation and compile counts (GPU).

The ``gpu`` tests need MLX's Metal or CUDA backend and are skipped cleanly on CPU. On a GPU host:
``python -m pytest -m gpu tests/test_qmv.py`` (`scripts/gpu.sh tests` runs them on CUDA).
"""

import functools
import hashlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from vqpipe.kernels import ext, qmv
from vqpipe.codec import bitpack
from vqpipe.codec.codebook import codebook as lloyd_codebook
from vqpipe.codec.bitpack import unpack, words_per_row
from vqpipe.layers.qlinear import QuantizedEmbedding, QuantizedLinear

needs_gpu = pytest.mark.skipif(qmv.backend() is None, reason="needs MLX's Metal or CUDA backend")
DTYPES = ("float16", "bfloat16", "float32")


def _same_bytes(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {2: mx.uint16, 4: mx.uint32}[a.dtype.size]
    return mx.array_equal(a.view(view), b.view(view)).item()


def _layer(n_in, n_out, bits=4, bias=True, seed=0):
    lin = nn.Linear(n_in, n_out, bias=bias)
    lin.update({"weight": mx.random.normal((n_out, n_in), key=mx.random.key(seed)) / np.sqrt(n_in)})
    if bias:
        lin.update({"bias": mx.random.normal((n_out,), key=mx.random.key(seed + 1)) * 0.1})
    return QuantizedLinear.from_linear(lin, bits, "auto", seed=seed)


def _dense_formula(layer, x):
    """What QuantizedLinear.__call__ computed before the kernel existed, written out."""
    y = layer.rotation.apply(x) @ layer.codebook.astype(x.dtype)[unpack(layer.packed, layer.bits, layer.in_features)].T
    y = y * layer.scales.astype(x.dtype)
    if "bias" in layer:
        y = y + layer.bias.astype(x.dtype)
    return y


# --- CPU: dispatch, switch, dialects, validation -------------------------------------------------


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 12])
def test_cpu_path_is_the_dense_formula(dt, rows):
    layer = _layer(96, 40, bits=3)
    x = mx.random.normal((1, rows, 96), key=mx.random.key(rows)).astype(getattr(mx, dt))
    with mx.stream(mx.cpu):
        assert not qmv.use_kernel(x)
        with ext.using(False):  # the dense path, as before the compiled mat-vec
            got, want = layer(x), _dense_formula(layer, x)
            mx.eval(got, want)
        fast = layer(x)  # decode sizes take vqpipe/kernels/ext.py's kernel: float32 sums, not the same bytes
    assert _same_bytes(got, want)
    if ext.available():
        assert np.allclose(np.array(fast.astype(mx.float32)), np.array(want.astype(mx.float32)), rtol=2e-2, atol=2e-2)


def test_cpu_embedding_as_linear_is_the_dense_formula():
    emb = nn.Embedding(300, 64)
    layer = QuantizedEmbedding.from_embedding(emb, 4, "auto", seed=2)
    x = mx.random.normal((1, 1, 64), key=mx.random.key(3))
    with mx.stream(mx.cpu), ext.using(False):
        got, want = layer.as_linear(x), _dense_formula(layer, x)
        mx.eval(got, want)
    assert _same_bytes(got, want)


def test_dispatch_off_without_gpu():
    x = mx.ones((1, 1, 64))
    with mx.stream(mx.cpu):
        assert qmv.backend() is None
        assert not qmv.kernels_active()
        assert not qmv.use_kernel(x)
        with pytest.raises(RuntimeError, match="Metal or CUDA"):
            qmv.kernels_active(True)
        layer = _layer(64, 8)
        with pytest.raises(RuntimeError, match="Metal or CUDA"):
            qmv.quantized_matvec(x, layer.packed, layer.scales, layer.codebook, 4, use_kernels=True)
        # use_kernels=None off the GPU: the dense reference, bytes equal
        got = qmv.quantized_matvec(x, layer.packed, layer.scales, layer.codebook, 4, layer.bias)
        want = qmv.reference(x, layer.packed, layer.scales, layer.codebook, 4, layer.bias)
        mx.eval(got, want)
        assert _same_bytes(got, want)


def test_use_kernel_decision(monkeypatch):
    monkeypatch.setattr(qmv, "backend", lambda: "cuda")  # pretend; nothing is launched here
    for m in range(1, qmv.MAX_M + 1):
        assert qmv.use_kernel(mx.zeros((1, m, 32), mx.bfloat16))
        assert qmv.use_kernel(mx.zeros((m, 32)))
    assert qmv.use_kernel(mx.zeros((2, 4, 32), mx.float16))  # M = 8 over two leading dims
    assert not qmv.use_kernel(mx.zeros((1, qmv.MAX_M + 1, 32)))  # prefill: the dense path
    assert not qmv.use_kernel(mx.zeros((0, 32)))
    assert not qmv.use_kernel(mx.zeros((1, 32), mx.int32))
    with qmv.enabled(False):
        assert not qmv.use_kernel(mx.zeros((1, 32)))
    assert qmv.use_kernel(mx.zeros((1, 32)))
    monkeypatch.setattr(qmv, "backend", lambda: None)
    assert not qmv.use_kernel(mx.zeros((1, 32)))


def test_switch():
    previous = qmv.set_enabled(False)
    try:
        assert not qmv.is_enabled() and not qmv.kernels_active()
        with qmv.enabled(True):
            assert qmv.is_enabled()
        assert not qmv.is_enabled()
        assert qmv.set_enabled(True) is False
    finally:
        qmv.set_enabled(previous)


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True), (None, True)])
def test_env_switch(value, expected):
    env = dict(os.environ)
    env.pop("VQPIPE_QMV_KERNELS", None)
    if value is not None:
        env["VQPIPE_QMV_KERNELS"] = value
    out = subprocess.run(
        [sys.executable, "-c", "from vqpipe.kernels import qmv; print(qmv.is_enabled())"],
        env=env, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1],
    )
    assert out.stdout.strip() == str(expected)


def test_one_description_two_dialects():
    (n_cuda, h_cuda, b_cuda), (n_metal, h_metal, b_metal) = (qmv.render(d) for d in ("cuda", "metal"))
    for name, header, body in ((n_cuda, h_cuda, b_cuda), (n_metal, h_metal, b_metal)):
        assert name == "vqpipe_qmv1_" + hashlib.sha1((header + body).encode()).hexdigest()[:10]
        left = {t for t in qmv.DIALECTS["cuda"]["tokens"] if t in body}
        assert not left, left  # every dialect token substituted
        for macro in qmv._HEADER_MACROS:  # the rest are macros each header defines
            assert f"#define {macro}(" in header
    assert n_cuda != n_metal
    assert all(s in b_cuda for s in ("__shared__", "__syncthreads()", "threadIdx.x", "blockIdx.x"))
    assert "__shfl_xor_sync" in h_cuda
    assert all(s in b_metal for s in ("threadgroup float", "threadgroup_barrier", "thread_position_in_threadgroup"))
    assert "simd_shuffle_xor" in h_metal
    # One description: each body maps back to the same source.
    for dialect, body in (("cuda", b_cuda), ("metal", b_metal)):
        for token, text in sorted(qmv.DIALECTS[dialect]["tokens"].items(), key=lambda kv: -len(kv[1])):
            body = body.replace(text, token)
        assert body == qmv.minify(qmv.body_source(1))
    # minified: no comments, no indentation, no blank lines; the code lines themselves unchanged
    assert "//" not in b_cuda + h_cuda and "\n\n" not in b_cuda and not b_cuda.startswith(" ")
    code = [ln.split("//")[0].strip() for ln in qmv.body_source(1).splitlines()]
    assert b_metal.count("\n") == sum(1 for ln in code if ln)
    # one kernel per output count, each with its own name (MLX caches by name)
    assert len({qmv.render("cuda", n)[0] for n in (1, 2, 3)}) == 3
    assert "out2[" in qmv.render("cuda", 3)[2] and "out1" not in qmv.render("cuda", 1)[2]
    # MLX finds shapes by name in the body: these must be referenced there.
    assert all(s in b_cuda for s in ("x_shape", "packed_shape", "bias_ndim"))
    # the Python launch geometry and the kernel's compile-time constants agree
    assert "constexpr int R = NR;" in qmv._SOURCE


QWEN = [(896, 896), (896, 128), (896, 4864), (4864, 896), (896, 151936), (4096, 11008), (11008, 4096)]


def _spec(n_in, n_out, m=1, bits=4, dtype=mx.bfloat16, bias=False, bias_dtype=None, group_size=None, xcap=0,
          splits=None, rows=None, lut=None):
    scales = (n_out,) if group_size is None else (n_out, n_in // group_size)
    return qmv.launch_spec((m, n_in), (n_out, words_per_row(n_in, bits)), scales, 1 << bits,
                           (n_out,) if bias else None, bits, dtype, bias_dtype, group_size=group_size, xcap=xcap,
                           splits=splits, rows=rows, lut=lut)


def test_launch_template_holds_no_shape():
    shapes = [(i, o) for i in (32, 50, 96, 896, 2048, 4864, 11008) for o in (1, 7, 128, 4864, 151936)]
    specs = [_spec(i, o) for i, o in shapes]
    assert all(s["template"] == specs[0]["template"] for s in specs)
    assert specs[0]["template"] == [("T", mx.bfloat16), ("BT", mx.bfloat16), ("ST", mx.float32), ("BITS", 4),
                                    ("MT", 1), ("GS", 0), ("XCAP", 0), ("RING", 0), ("LUT", 0),
                                    ("NR", qmv.ROWS)]
    assert len({s["grid"] for s in specs}) >= 10  # the grid follows the shape, the kernel does not
    for s in specs:
        tx, ks, rw = s["threadgroup"]
        # 256 threads with the 4-bit pair table (8 warps share one table), else 128 (the ring is sized for them)
        assert tx == 32 and ks in (1, 2, 4) and ks * rw == qmv.warps_per_group(s["template"][8][1], 4)
        assert s["grid"][1:] == (ks, rw) and s["grid"][0] % 32 == 0
    # M enters as MT = next power of two; the bias dtype only where a layer has one
    assert [_spec(896, 896, m)["template"][4][1] for m in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert _spec(896, 896, bias=True, bias_dtype=mx.float32)["template"][1] == ("BT", mx.float32)
    # rows are split over warps only where there are few, long rows: the down projections, not the lm_head
    ks = {(i, o): _spec(i, o)["threadgroup"][1] for i, o in QWEN}
    assert ks[(4864, 896)] == 4 and ks[(11008, 4096)] == 4 and ks[(896, 151936)] == 1 and ks[(896, 896)] == 1


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bits": 5}, "bits must be one of"),
        ({"dtype": mx.int32}, "x dtype must be"),
        ({"m": 9}, "M = 9 rows"),
        ({"packed_shape": (40, 7)}, "words per row"),
        ({"packed_shape": (40 * 12,)}, "must be 2-D"),
        ({"packed_dtype": mx.int32}, "packed must be uint32"),
        ({"scales_shape": (41,)}, "scales must have shape (40,)"),
        ({"codebook_size": 8}, "4-bit codebook has 16 levels"),
        ({"bias_shape": (1, 40)}, "bias must have shape (40,)"),
        ({"in_features": 0}, "empty last dimension"),
    ],
)
def test_validation_names_the_problem(change, message):
    args = {"in_features": 96, "m": 1, "packed_shape": (40, 12), "packed_dtype": mx.uint32, "scales_shape": (40,),
            "codebook_size": 16, "bias_shape": None, "bits": 4, "dtype": mx.float16}
    qmv.check_args(**args)  # the unchanged arguments are fine
    args.update(change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        qmv.check_args(**args)


def test_validation_through_launch_spec():
    with pytest.raises(ValueError, match="words per row"):
        qmv.launch_spec((1, 100), (8, 12), (8,), 16, None, 4, mx.float32)


# --- the float64 reference (checked on CPU, used on GPU) ---------------------------------------


@functools.lru_cache(maxsize=64)
def _weights(bits, n_in, n_out, seed=0, group_size=None):
    """Packed indices (random garbage in the row padding too), scales (per row, or [out, in // group_size]),
    a codebook, a bias; numpy."""
    rng = np.random.default_rng([bits, n_in, n_out, seed, group_size or 0])
    idx = rng.integers(0, 1 << bits, size=(n_out, bitpack.padded_length(n_in)), dtype=np.uint8)
    packed = bitpack.pack(idx, bits)
    levels = (lloyd_codebook(bits, max(n_in, 3)) / np.sqrt(n_in)).astype(np.float32) if bits <= 4 else \
        (rng.standard_normal(1 << bits) / np.sqrt(n_in)).astype(np.float32)
    shape = n_out if group_size is None else (n_out, n_in // group_size)
    scales = rng.uniform(0.5, 1.5, shape).astype(np.float32)
    bias = (rng.standard_normal(n_out) * 0.5).astype(np.float32)
    return packed, scales, levels, bias


_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}


def _reference64(x, packed, scales, levels, bias, bits, group_size=None, x64=None, xerr=None):
    """(y, tolerance) in float64. The kernel converts x and the codebook to float32 exactly and
    accumulates ~n products in float32 (each add or FMA rounds by at most 2^-24 relative to a running
    sum bounded by sum|c x|), then one multiply by s, one add of b, one cast to x's dtype (half an
    ulp: eps/2 relative, plus the smallest subnormal for fp16)."""
    n = x.shape[-1]
    xd = np.array(x.astype(mx.float32), dtype=np.float64).reshape(-1, n) if x64 is None else x64
    w = levels.astype(np.float64)[bitpack.unpack_numpy(packed, bits, n)]
    s = np.array(scales, dtype=np.float64)
    if s.ndim == 2:  # per group: the scales weight the codebook values, then s = 1 per row
        w = w * np.repeat(s, group_size, axis=1)[:, :n]
        s = np.ones(w.shape[0])
    acc = xd @ w.T
    b = 0.0 if bias is None else np.array(bias.astype(mx.float32), dtype=np.float64)
    y = acc * s + b
    dt = str(x.dtype).rsplit(".", 1)[-1]
    err32 = s * (n + 48) * 2.0**-24 * (np.abs(xd) @ np.abs(w).T) + 2.0**-23 * (np.abs(acc * s) + np.abs(b))
    if xerr is not None:  # the activation's own error (rotated in float32 by the kernel)
        err32 = err32 + s * (xerr @ np.abs(w).T)
    tol = err32 + _EPS[dt] / 2 * (np.abs(y) + err32) + (2.0**-24 if dt == "float16" else 1e-37)
    return y, tol


def _check(got, y, tol):
    g = np.array(got.astype(mx.float32), dtype=np.float64).reshape(y.shape)
    excess = np.abs(g - y) / tol
    assert np.isfinite(g).all()
    assert excess.max() <= 1, f"error {excess.max():.2f}x the bound at {np.unravel_index(excess.argmax(), y.shape)}"


def test_reference64_matches_dense_formula_on_cpu():
    # The numpy reference computes the same formula as the MLX dense path (here in float32).
    packed, scales, levels, bias = _weights(3, 50, 7)
    x = mx.random.normal((2, 50), key=mx.random.key(9))
    with mx.stream(mx.cpu):
        dense = qmv.reference(x, mx.array(packed), mx.array(scales), mx.array(levels), 3, mx.array(bias))
        mx.eval(dense)
    y, tol = _reference64(x, packed, scales, levels, mx.array(bias), 3)
    _check(dense, y, tol * 4)  # the dense path accumulates in another order: a looser bound


def test_bench_quick_runs_on_cpu(tmp_path):
    from experiments import bench_qmv as bench

    out = tmp_path / "q.json"
    with mx.stream(mx.cpu):
        assert bench.main(["--quick", "--out", str(out), "--shapes", "qwen-k/v", "--modes", "isolated", "chained"]) == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "bench-qmv" and doc["copy_bandwidth"]["median"] > 0
    assert set(doc["skipped_arms"]) == {"vq-kernel", "vq-core"}
    assert [r["mode"] for r in doc["results"]] == ["isolated", "chained"]
    r = doc["results"][0]
    assert {"dense-fp16", "dense-bf16", "affine4", "vq-ref", "vq-ref (A/A)"} <= set(r["arms"])
    assert r["bytes_per_call"]["vq-ref"] < r["bytes_per_call"]["affine4"] < r["bytes_per_call"]["dense-bf16"]
    assert all(c["floor"] == r["noise_floor"] for c in r["comparisons"].values())


# --- GPU: the kernel against the float64 reference ----------------------------------------------


def _configs():
    out = []
    # 4 bits, bf16: every M, ragged and round in/out features, bias on half of them
    for i, (n_in, n_out, m) in enumerate(itertools.product((50, 96, 896, 4864), (1, 7, 128, 4864), range(1, 9))):
        out.append((4, "bfloat16", n_in, n_out, m, i % 2 == 0))
    # 2, 3 and 8 bits in every dtype, M = 1 and 5
    for bits, dt, n_in, n_out, m in itertools.product((2, 3, 8), DTYPES, (50, 896, 4864), (7, 128), (1, 5)):
        out.append((bits, dt, n_in, n_out, m, m == 5))
    # 4 bits in fp16/fp32
    for dt, n_in, n_out, m in itertools.product(("float16", "float32"), (96, 4864), (1, 4864), (1, 8)):
        out.append((4, dt, n_in, n_out, m, n_out == 1))
    return out


CONFIGS = _configs()


def _run(bits, dt, n_in, n_out, m, with_bias, key=0, bias_dtype=None, group_size=None, scales_dtype=mx.float32):
    packed, scales, levels, bias = _weights(bits, n_in, n_out, group_size=group_size)
    x = mx.random.normal((1, m, n_in), key=mx.random.key(key)).astype(getattr(mx, dt))
    b = mx.array(bias).astype(bias_dtype or getattr(mx, dt)) if with_bias else None
    s = mx.array(scales).astype(scales_dtype)
    got = qmv.quantized_matvec(x, mx.array(packed), s, mx.array(levels), bits, b, use_kernels=True,
                               group_size=group_size)
    mx.eval(got)
    return x, b, got


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_float64_reference(cfg):
    bits, dt, n_in, n_out, m, with_bias = cfg
    x, b, got = _run(*cfg, key=CONFIGS.index(cfg))
    assert got.shape == (1, m, n_out) and got.dtype == x.dtype
    packed, scales, levels, _ = _weights(bits, n_in, n_out)
    _check(got, *_reference64(x, packed, scales, levels, b, bits))


GROUP_CONFIGS = [(bits, dt, n_in, n_out, m, gs, sdt)
                 for bits, gs in ((2, 32), (2, 64), (3, 64), (3, 256), (4, 32), (4, 128), (4, 256), (8, 32))
                 for dt, n_in, n_out, m, sdt in (("bfloat16", 896, 128, 1, "float32"), ("float16", 4864, 7, 5, "float16"),
                                                 ("float32", 256, 4864, 8, "float32"), ("bfloat16", 4096, 256, 2, "float16"))
                 if n_in % gs == 0]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cfg", GROUP_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_kernel_group_scales_match_float64_reference(cfg):
    bits, dt, n_in, n_out, m, gs, sdt = cfg
    x, b, got = _run(bits, dt, n_in, n_out, m, True, key=GROUP_CONFIGS.index(cfg), group_size=gs,
                     scales_dtype=getattr(mx, sdt))
    packed, scales, levels, _ = _weights(bits, n_in, n_out, group_size=gs)
    scales = np.array(mx.array(scales).astype(getattr(mx, sdt)).astype(mx.float32))  # what the kernel read
    _check(got, *_reference64(x, packed, scales, levels, b, bits, gs))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cfg", [(4, "bfloat16", 4096, 1000, 1, True), (3, "float16", 896, 777, 2, False),
                                 (2, "float32", 4864, 301, 5, True), (4, "bfloat16", 96, 999, 8, False)])
def test_kernel_grid_stride_against_float64(cfg):
    # 3 threadgroups for hundreds of row sets: each warp takes row sets grid-stride, requesting the
    # next one's first chunk during the current one's last
    bits, dt, n_in, n_out, m, with_bias = cfg
    with qmv.block_limit(3):
        x, b, got = _run(*cfg, key=n_out)
    assert qmv.launch_spec(x.shape, (n_out, words_per_row(n_in, bits)), (n_out,), 1 << bits,
                           (n_out,) if with_bias else None, bits, x.dtype, max_blocks=3)["grid"][0] == 3 * 32
    packed, scales, levels, _ = _weights(bits, n_in, n_out)
    _check(got, *_reference64(x, packed, scales, levels, b, bits))


@pytest.mark.gpu
@needs_gpu
def test_kernel_bias_in_another_dtype():
    x, b, got = _run(4, "bfloat16", 896, 128, 1, True, bias_dtype=mx.float32)
    packed, scales, levels, _ = _weights(4, 896, 128)
    _check(got, *_reference64(x, packed, scales, levels, b, 4))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cfg", [(4, "bfloat16", 4864, 4864, 1), (3, "float16", 896, 20000, 2), (2, "float32", 4864, 896, 8)])
def test_kernel_is_deterministic(cfg):
    first = _run(*cfg, True)
    for _ in range(3):
        again = _run(*cfg, True)
        assert _same_bytes(first[2], again[2])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
def test_unaligned_activation_takes_the_scalar_path(dt):
    # A row-contiguous view at an odd element offset is passed as is (no copy): the kernel's
    # 16-byte alignment check sends it down the scalar loads, with the same result bytes.
    packed, scales, levels, bias = (mx.array(a) for a in _weights(4, 896, 256))
    big = mx.random.normal((3 * 896,), key=mx.random.key(1)).astype(getattr(mx, dt))
    view = big[1 : 1 + 896].reshape(1, 896)
    copy = view.astype(mx.float32).astype(view.dtype)  # a fresh (aligned) array, same values
    a = qmv.quantized_matvec(view, packed, scales, levels, 4, bias.astype(view.dtype), use_kernels=True)
    b = qmv.quantized_matvec(copy, packed, scales, levels, 4, bias.astype(view.dtype), use_kernels=True)
    mx.eval(a, b)
    assert _same_bytes(a, b)


PROLOGUE_CONFIGS = [("hadamard", 896, 4, 1152, 1, "bfloat16", (896, 1024)), ("kron", 1472, 4, 896, 1, "bfloat16", None),
                    ("hadamard", 4096, 4, 6144, 1, "float16", (4096, 5120)), ("hadamard", 2048, 3, 512, 2, "float32", None),
                    ("kron", 1472, 2, 300, 1, "bfloat16", (100,)), ("hadamard", 768, 4, 64, 4, "float32", (32, 48)),
                    ("kron", 2432, 4, 200, 1, "float32", (150,))]


def test_prologue_only_where_verified():
    """("hadamard", 896, 8 bits, 100, M = 8, bf16) missed the float64 bound 2.94x on the H200: such
    launches must take the MLX-op rotation (the test above then covers only verified shapes)."""
    assert all(qmv.prologue_allowed(b, m) for b in (2, 3, 4) for m in (1, 2, 4))
    assert not qmv.prologue_allowed(8, 1) and not qmv.prologue_allowed(4, 8)
    assert all(qmv.prologue_allowed(c[2], c[4]) for c in PROLOGUE_CONFIGS)


def test_prologue_configs_fit_the_shared_memory():
    """The GPU prologue tests must run the prologue, not the MLX-op fallback: their staged rows fit
    a bucket (with the ring's 2 stages beside it); qwen's 4864-wide down_proj (10944 floats) does not."""
    from vqpipe.codec.rotation import make_rotation

    for kind, n_in, bits, _, m, _, _ in PROLOGUE_CONFIGS:
        a = qmv.rotation_operands(make_rotation(kind, n_in, seed=7))[1].shape[0]
        assert qmv.prologue_floats(bits, n_in, m, a) <= qmv.MAX_XCAP["cuda"] == max(qmv.XCAP_BUCKETS)
    assert qmv.prologue_floats(4, 4864, 1, 19) > qmv.MAX_XCAP["cuda"]
    assert qmv.prologue_floats(4, 4096, 1, 1) <= qmv.MAX_XCAP["cuda"]  # the 8B q|k|v and gate|up inputs


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cfg", PROLOGUE_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_kernel_prologue_rotation_matches_float64(cfg):
    from vqpipe.codec.rotation import make_rotation

    kind, n_in, bits, n_out, m, dt, splits = cfg
    r = make_rotation(kind, n_in, seed=7)
    packed, scales, levels, bias = _weights(bits, n_in, n_out)
    x = mx.random.normal((1, m, n_in), key=mx.random.key(n_out)).astype(getattr(mx, dt))
    b = mx.array(bias).astype(x.dtype)
    args = (mx.array(packed), mx.array(scales), mx.array(levels), bits, b, None, r)
    previous = qmv.set_rotate_in_kernel(True)
    try:
        with_splits = qmv.launch(qmv.backend(), x, *args, splits=splits) if splits else None
        got = qmv.launch(qmv.backend(), x, *args)
        mx.eval(got, with_splits)
    finally:
        qmv.set_rotate_in_kernel(previous)
    sd, lm = (np.array(a, np.float64) for a in qmv.rotation_operands(r))
    a = lm.shape[0]
    big = np.kron(lm, _sylvester(n_in // a) / np.sqrt(n_in // a)) * sd[None, :]
    xin = np.array(x.astype(mx.float32), np.float64).reshape(m, n_in)
    xerr = (np.log2(n_in // a) + a + 3) * 2.0**-24 * (np.abs(xin) @ np.abs(big).T)
    _check(got, *_reference64(x, packed, scales, levels, b, bits, x64=xin @ big.T, xerr=xerr))
    if splits:  # the outputs are the row ranges of the single-output launch, byte for byte
        ends = [0, *splits, n_out]
        for k, part in enumerate(with_splits):
            assert part.shape == (1, m, ends[k + 1] - ends[k])
            want = np.array(got[..., ends[k]:ends[k + 1]].astype(mx.float32))
            assert np.array_equal(np.array(part.astype(mx.float32)), want)


# --- GPU: layers, generation ---------------------------------------------------------------------


def _rel(a, b):
    a, b = (np.array(t.astype(mx.float32), dtype=np.float64) for t in (a, b))
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dt, bound", [("bfloat16", 0.03), ("float32", 1e-4)])
@pytest.mark.parametrize("n_in, n_out, bits", [(896, 4864, 4), (4864, 896, 3), (256, 128, 2)])
def test_quantized_linear_kernel_close_to_dense(dt, bound, n_in, n_out, bits):
    layer = _layer(n_in, n_out, bits=bits, bias=True, seed=n_in)
    x = mx.random.normal((1, 1, n_in), key=mx.random.key(5)).astype(getattr(mx, dt))
    with qmv.enabled(True):
        assert qmv.use_kernel(x)
        on = layer(x)
    with qmv.enabled(False):
        off = layer(x)
    core = qmv.quantized_matvec(layer.rotation.apply(x), layer.packed, layer.scales, layer.codebook, bits, layer.bias,
                                use_kernels=True)
    previous = qmv.set_rotate_in_kernel(False)
    try:
        with qmv.enabled(True):
            on_mlx_rotation = layer(x)
    finally:
        qmv.set_rotate_in_kernel(previous)
    mx.eval(on, off, core, on_mlx_rotation)
    assert on.dtype == off.dtype == x.dtype and on.shape == off.shape
    assert _same_bytes(on_mlx_rotation, core)  # without the prologue the layer is MLX's rotation + the kernel
    assert _rel(on, core) < bound  # the prologue rotates in float32 instead
    # the dense path rounds the codebook and the output to x's dtype: bf16 differs by ~2^-8
    assert _rel(on, off) < bound


@pytest.mark.gpu
@needs_gpu
def test_embedding_as_linear_and_prefill_fallback():
    emb = nn.Embedding(3000, 256)
    layer = QuantizedEmbedding.from_embedding(emb, 4, "auto", seed=1)
    x = mx.random.normal((1, 1, 256), key=mx.random.key(2)).astype(mx.bfloat16)
    with qmv.enabled(True):
        on = layer.as_linear(x)
        n0 = qmv.compiled_kernel_count()
        prefill_on = layer.as_linear(mx.concatenate([x] * (qmv.MAX_M + 1), axis=1))
    with qmv.enabled(False):
        off = layer.as_linear(x)
        prefill_off = layer.as_linear(mx.concatenate([x] * (qmv.MAX_M + 1), axis=1))
    mx.eval(on, off, prefill_on, prefill_off)
    assert on.shape == (1, 1, 3000) and _rel(on, off) < 0.03
    assert _same_bytes(prefill_on, prefill_off)  # M > MAX_M: the dense path either way
    assert qmv.compiled_kernel_count() == n0


def _decode(model, prompt, steps, on):
    from mlx_lm.models.cache import make_prompt_cache

    with qmv.enabled(on):
        cache = make_prompt_cache(model)
        logits = model(mx.array(prompt)[None], cache=cache)[0, -1].astype(mx.float32)  # prefill: dense
        tokens, logps = [], []
        for _ in range(steps):
            logp = logits - mx.logsumexp(logits)
            tok = int(mx.argmax(logits).item())
            tokens.append(tok)
            logps.append(np.array(logp, dtype=np.float64))
            logits = model(mx.array([[tok]]), cache=cache)[0, -1].astype(mx.float32)  # M = 1: the kernel
    return tokens, logps


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dt, embeddings", [("float32", True), ("bfloat16", False)])
def test_generation_kernel_on_off(dt, embeddings, tmp_path_factory, monkeypatch):
    from mlx_lm import load

    from vqpipe.stages.download import fetch
    from vqpipe.quant.config import QuantizeConfig
    from vqpipe.quant.quantize import quantize_model

    path = fetch("synth:tiny", tmp_path_factory.mktemp("qmv") / "tiny", seed=0)
    model, tok = load(str(path))
    # float32: every linear and the tied head (QuantizedEmbedding.as_linear) quantized; the
    # quantized embedding yields float32 activations. bfloat16: the embedding (and tied head) kept
    # dense in bf16, so the quantized linears see bf16 activations.
    quantize_model(model, QuantizeConfig(embeddings=embeddings, dtype=dt, threads=1, calib_text="none", codes="scalar"))
    launches = []
    real = qmv.launch

    def counted(*a, **k):
        launches.append(a[1].shape)
        return real(*a, **k)

    monkeypatch.setattr(qmv, "launch", counted)
    prompt = tok.encode("The rotation spreads the outliers over every coordinate, and the codebook")
    on = _decode(model, prompt, 8, True)
    assert launches and all(s[:-1] == (1, 1) for s in launches)  # decode steps ran the kernel, prefill did not
    n_on = len(launches)
    off = _decode(model, prompt, 8, False)
    assert len(launches) == n_on
    # Compare while the two runs saw the same tokens: a KL bound on every step, and equal tokens
    # unless the two best logits are closer than what the two paths can disagree by.
    same_prefix = 0
    while same_prefix < 8 and on[0][:same_prefix] == off[0][:same_prefix]:
        p_off, p_on = np.exp(off[1][same_prefix]), on[1][same_prefix]
        kl = float(np.sum(p_off * (off[1][same_prefix] - p_on)))
        assert kl < (1e-4 if dt == "float32" else 2e-2), (same_prefix, kl)
        same_prefix += 1
    if on[0][:4] != off[0][:4]:
        i = next(j for j in range(4) if on[0][j] != off[0][j])
        top2 = np.sort(off[1][i])[-2:]
        drift = np.abs(on[1][i] - off[1][i]).max()
        assert top2[1] - top2[0] <= 2 * drift, (on[0], off[0], top2, drift)


# --- GPU: compiled kernels stay fixed across shapes -----------------------------------------------


def _ptx_files():
    d = os.environ.get("MLX_PTX_CACHE_DIR") or Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"
    d = Path(d)
    return sorted(p.name for p in d.glob("custom_kernel_vqpipe_qmv*.ptx")) if d.is_dir() else []


def _kernel_counts_across_shapes():
    """(kernels compiled, PTX files in MLX's cache) after each of 42 shapes, in this process."""
    shapes = [(i, o) for i in (32, 50, 96, 256, 896, 2048, 4864) for o in (1, 3, 7, 128, 896, 5000)]
    counts, ptx = [], []
    for k, (n_in, n_out) in enumerate(shapes):
        packed, scales, levels, bias = _weights(4, n_in, n_out)
        x = mx.random.normal((1, 1, n_in), key=mx.random.key(k)).astype(mx.float16)
        y = qmv.quantized_matvec(x, mx.array(packed), mx.array(scales), mx.array(levels), 4, use_kernels=True)
        mx.eval(y)
        counts.append(qmv.compiled_kernel_count())
        ptx.append(_ptx_files())
    return counts, ptx


@pytest.mark.gpu
@needs_gpu
def test_compiled_kernel_count_fixed_across_shapes(tmp_path):
    # A process of its own with a PTX cache of its own: other test processes (pytest-xdist) write
    # their kernels into the shared default cache while this one runs.
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from test_qmv import _kernel_counts_across_shapes; "
            "print(json.dumps(_kernel_counts_across_shapes()))")
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path / "ptx"))
    run = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    counts, ptx = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(set(counts)) == 1, counts
    assert all(p == ptx[0] for p in ptx), ptx
    assert ptx[0] or qmv.backend() != "cuda"  # CUDA: the kernel's PTX is in this process's cache


# --- CPU: the kernel body itself, rendered for a host "dialect" ----------------------------------
# Every GPU thread becomes a std::thread (one threadgroup at a time), shared memory a static array,
# barriers std::barrier, shuffles an exchange through memory. It checks the description's index
# math, the row split and the reductions without a GPU (float32 activations; not the vector loads).

_HOST_TOKENS = {
    "QMV_SHARED": "static", "QMV_BARRIER": "g_block_barrier->arrive_and_wait()", "QMV_LANE": "t_lane",
    "QMV_KS_ID": "t_ks", "QMV_KS": "g_KS", "QMV_RW_ID": "t_rw", "QMV_RW": "g_RW", "QMV_BLOCK": "g_block",
    "QMV_BLOCKS": "g_blocks", "QMV_UNROLL": "", "QMV_SHARED16": "alignas(16) static",
    "QMV_MAIN_BEGIN": qmv.DIALECTS["cuda"]["tokens"]["QMV_MAIN_BEGIN"], "QMV_XV": qmv.DIALECTS["cuda"]["tokens"]["QMV_XV"],
    "QMV_MAIN_END": qmv.DIALECTS["cuda"]["tokens"]["QMV_MAIN_END"],
}
_HOST_HEADER = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
static std::barrier<>* g_block_barrier;
static std::vector<std::barrier<>*> g_warp_barriers;
static unsigned int g_KS, g_RW, g_block, g_blocks;
static thread_local unsigned int t_lane, t_ks, t_rw;
static float g_xchg[8][32];
inline unsigned int qmv_umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline float qmv_inv_sqrt(float v) { return 1.0f / std::sqrt(v); }
inline unsigned int qmv_log2(unsigned int v) { return (unsigned int)__builtin_ctz(v); }
struct float2 { float x, y; };
inline float2 qmv_f2(float a, float b) { return float2{a, b}; }
template <bool B>
struct qmv_bool { static constexpr bool value = B; };
inline float qmv_shfl_xor(float v, int m) {
  unsigned int w = t_rw * g_KS + t_ks;
  g_xchg[w][t_lane] = v;
  g_warp_barriers[w]->arrive_and_wait();
  float r = g_xchg[w][t_lane ^ m];
  g_warp_barriers[w]->arrive_and_wait();
  return r;
}
template <int BITS, int PER>
inline unsigned int qmv_index(const unsigned int* w, int v) {
  if (BITS != 3) return (w[v / PER] >> (BITS * (v % PER))) & ((1u << BITS) - 1u);
  const int bit = 3 * v, j = bit >> 5, sh = bit & 31;
  if (sh + 3 <= 32) return (w[j] >> sh) & 7u;
  return ((w[j] >> sh) | (w[j + 1] << (32 - sh))) & 7u;
}
// Revision 7's pair lookup as the CUDA header has it (byte offsets), the funnel shift written out.
template <int BITS, int PLS>
inline unsigned int qmv_pair_off(const unsigned int* w, int p, unsigned int lcp) {
  const int bit = 2 * BITS * p, j = bit >> 5, sh = bit & 31;
  const unsigned int mask = ((1u << (2 * BITS)) - 1u) << PLS;
  unsigned int v;
  if (sh + 2 * BITS <= 32) v = sh >= PLS ? (w[j] >> (sh - PLS)) : (w[j] << (PLS - sh));
  else v = (w[j] >> (sh - PLS)) | (w[j + 1] << (32 - (sh - PLS)));
  return (v & mask) | (lcp << 3);
}
template <int BITS, int PLS>
inline float2 qmv_pair(const float2* t, const unsigned int* w, int p, unsigned int lcp) {
  const unsigned int off = qmv_pair_off<BITS, PLS>(w, p, lcp);
  if (off % 8u || off / 8u >= (1u << (2 * BITS)) * (BITS > 2 ? 16u : 1u)) { fprintf(stderr, "pair lookup out of the table\n"); abort(); }
  return *reinterpret_cast<const float2*>(reinterpret_cast<const unsigned char*>(t) + off);
}
// The ring's copies are synchronous here (the wait is nothing); the "vector" branch is checked for
// alignment like the GPU's 16-byte copies.
template <int VW, int R, int NTB>
inline void qmv_fetch(unsigned int* dst, const uint32_t* p, unsigned int row0, unsigned int c, unsigned int OUT,
                      unsigned int WPR, bool valid, bool vec) {
  for (int r = 0; r < R; ++r) {
    const unsigned int row = qmv_umin(row0 + (unsigned int)r, OUT - 1u) * WPR;
    const unsigned int left = valid ? WPR - c * VW : 0u;
    if (VW == 4 && vec && valid && (((unsigned long long)(p + row + c * VW) & 15ull) != 0ull)) {
      fprintf(stderr, "misaligned vector copy\n"); abort();
    }
    for (int w = 0; w < VW; ++w) dst[r * NTB * VW + w] = (unsigned int)w < left ? p[row + c * VW + w] : 0u;
  }
}
template <int VW, int R>
inline void qmv_load_rows(unsigned int (*dst)[VW], const uint32_t* p, unsigned int row0, unsigned int c, unsigned int OUT,
                          unsigned int WPR, bool valid, unsigned int NCH, bool vec) {
  valid = valid && row0 < OUT && c < NCH;
  for (int r = 0; r < R; ++r) {
    const unsigned int off = qmv_umin(row0 + (unsigned int)r, OUT - 1u) * WPR + c * VW;
    if (valid && VW == 4 && vec && (((unsigned long long)(p + off) & 15ull) != 0ull)) {
      fprintf(stderr, "misaligned vector load\n"); abort();
    }
    for (int w = 0; w < VW; ++w) dst[r][w] = (valid && c * VW + (unsigned int)w < WPR) ? p[off + w] : 0u;
  }
}
template <int N>
inline void qmv_async_wait() {}
template <int VW>
inline void qmv_ring_read(unsigned int* dst, const unsigned int* src) {
  for (int w = 0; w < VW; ++w) {
    dst[w] = src[w];
  }
}
#define QMV_LOAD_X(dst, p, vec) for (int t_ = 0; t_ < SC; ++t_) { (dst)[t_] = (p)[t_]; }
#define QMV_X_ALIGNED(p) false
inline unsigned int qmv_xi(unsigned int i) { return i + ((i >> 5) << 2); }
#define QMV_LOAD_XS(dst, p) do { if (((unsigned long long)(p) & 15ull) != 0ull) { fprintf(stderr, "misaligned xs\n"); abort(); } \
  for (int t_ = 0; t_ < SC; ++t_) { (dst)[t_] = (p)[t_]; } } while (0)
#define QMV_W_ALIGNED(p) ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull)
"""
_HOST_MAIN = r"""
template <int BITS, int MT, int GS, int XCAP>
void run(char** argv) {
  int M = atoi(argv[5]), DIN = atoi(argv[6]), OUT = atoi(argv[7]), WPR = atoi(argv[8]);
  g_KS = atoi(argv[9]); g_RW = atoi(argv[10]); int blocks = atoi(argv[11]), has_bias = atoi(argv[12]);
  int G = atoi(argv[13]), A = atoi(argv[14]), S0 = atoi(argv[15]), S1 = atoi(argv[16]);
  int ROTN = XCAP > 0 ? DIN : 1;
  g_blocks = blocks;
  std::vector<float> x((size_t)M * DIN), s((size_t)OUT * G), cb(1 << BITS), b(OUT), rs(ROTN), rl((size_t)A * A);
  std::vector<float> o0((size_t)M * S0, -1.0f), o1((size_t)M * (S1 - S0) + 1, -1.0f), o2((size_t)M * (OUT - S1) + 1, -1.0f);
  std::vector<uint32_t> pk((size_t)OUT * WPR);
  FILE* f = fopen(argv[17], "rb");
  size_t n = fread(x.data(), 4, x.size(), f) + fread(pk.data(), 4, pk.size(), f) + fread(s.data(), 4, s.size(), f)
      + fread(cb.data(), 4, cb.size(), f) + fread(b.data(), 4, b.size(), f) + fread(rs.data(), 4, rs.size(), f)
      + fread(rl.data(), 4, rl.size(), f);
  fclose(f);
  if (n != x.size() + pk.size() + s.size() + cb.size() + b.size() + rs.size() + rl.size()) return;
  int xs[2] = {M, DIN}, ps[2] = {OUT, WPR}, ss[2] = {OUT, G}, ls[2] = {A, A}, seg[2] = {S0, S1};
  for (int blk = 0; blk < blocks; ++blk) {
    g_block = blk;
    int nt = 32 * g_KS * g_RW;
    std::barrier<> bb(nt);
    g_block_barrier = &bb;
    std::vector<std::barrier<>*> wb;
    for (unsigned w = 0; w < g_KS * g_RW; ++w) wb.push_back(new std::barrier<>(32));
    g_warp_barriers = wb;
    std::vector<std::thread> th;
    for (int t = 0; t < nt; ++t)
      th.emplace_back([&, t] {
        t_lane = t % 32; t_ks = (t / 32) % g_KS; t_rw = t / (32 * g_KS);
        kernel<BITS, MT, GS, XCAP>(x.data(), xs, 2, pk.data(), ps, s.data(), ss, cb.data(), b.data(), has_bias ? 1 : 2,
                                   rs.data(), rl.data(), ls, seg, o0.data(), o1.data(), o2.data());
      });
    for (auto& t : th) t.join();
    for (auto* p : wb) delete p;
  }
  f = fopen(argv[18], "wb");
  fwrite(o0.data(), 4, (size_t)M * S0, f);
  fwrite(o1.data(), 4, (size_t)M * (S1 - S0), f);
  fwrite(o2.data(), 4, (size_t)M * (OUT - S1), f);
  fclose(f);
}
int main(int argc, char** argv) {
  int bits = atoi(argv[1]), mt = atoi(argv[2]), gs = atoi(argv[3]), xcap = atoi(argv[4]);
#define C(B, T, S, X) if (bits == B && mt == T && gs == S && xcap == X) { run<B, T, S, X>(argv); return 0; }
  C(2, 1, 0, 0) C(2, 4, 0, 0) C(3, 1, 0, 0) C(3, 2, 0, 0) C(3, 4, 0, 0) C(4, 1, 0, 0) C(4, 2, 0, 0) C(4, 4, 0, 0) C(4, 8, 0, 0)
  C(8, 1, 0, 0) C(8, 4, 0, 0) C(4, 1, 32, 0) C(4, 2, 128, 0) C(2, 1, 32, 0) C(2, 4, 32, 0) C(2, 4, 64, 0)
  C(3, 1, 64, 0) C(3, 2, 256, 0) C(8, 1, 32, 0) C(4, 8, 256, 0)
  C(4, 1, 0, 2048) C(4, 1, 0, 4096) C(4, 1, 0, 7168) C(4, 2, 0, 4096) C(3, 1, 0, 2048) C(2, 4, 64, 7168) C(4, 1, 64, 1024)
  C(4, 1, 0, 7168) C(2, 1, 0, 2048) C(8, 2, 0, 4096) C(4, 8, 0, 7168)
  C(2, 2, 64, 7168) C(4, 2, 0, 7168) C(2, 1, 0, 1024) C(8, 2, 0, 2048) C(4, 1, 32, 1024) C(8, 2, 0, 1024) C(8, 4, 0, 1024)
  return 1;
}
"""


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory):  # the default: revision 6's lookups, 4 rows per warp
    return _build_host(tmp_path_factory, qmv.ROWS, 0)


@pytest.fixture(scope="module")
def host_kernel_lut(tmp_path_factory):  # revision 7's pair tables where they apply (registers, no prologue)
    return _build_host(tmp_path_factory, qmv.ROWS, 1)


@pytest.fixture(scope="module")
def host_kernel_r2(tmp_path_factory):  # pair tables and 2 rows per warp
    return _build_host(tmp_path_factory, 2, 1)


def _build_host(tmp_path_factory, rows, lut):
    import re
    import shutil

    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler for the host rendering of the kernel")
    body = qmv.body_source(3)  # single outputs: seg = [OUT, OUT]
    for token, text in _HOST_TOKENS.items():
        body = re.sub(rf"\b{token}\b", text, body)
    body = qmv.minify(body)  # the form MLX is given (comments and indentation stripped)
    src = (_HOST_HEADER + "template <int BITS, int MT, int GS, int XCAP>\nvoid kernel(const float* x, const int* x_shape, "
           "int x_ndim, const uint32_t* packed, const int* packed_shape, const float* scales, const int* scales_shape, "
           "const float* codebook, const float* bias, int bias_ndim, const float* rot_s, const float* rot_l, "
           "const int* rot_l_shape, const int* seg, float* out0, float* out1, float* out2) {\n using T = float;\n"
           " constexpr int RING = MT <= 4 ? 0 : 3;\n"  # registers, and a ring whose 3 slots wrap unevenly
           # with lut = 1 revision 7's pair tables where they apply (registers, no prologue), as qmv.lut_for
           f" constexpr int LUT = {lut} && RING == 0 && XCAP == 0 && BITS <= 4 ? 1 : 0;\n"
           f" constexpr int NR = {rows};\n"
           + body + "}\n" + _HOST_MAIN)
    d = tmp_path_factory.mktemp("qmv_host")
    (d / "k.cpp").write_text(src)
    # -O0: the compile is most of this fixture's cost (8.9-11.2 s at -O1, 3.7-4.9 s at -O0, load ~9)
    # and the 47 host tests run no slower (20.8 s at -O1, load 11; 18.1 s at -O0, load 18)
    r = subprocess.run([cxx, "-std=c++20", "-O0", "-pthread", "k.cpp", "-o", "k"], cwd=d, capture_output=True, text=True)
    if r.returncode != 0 and "barrier" in r.stderr:
        pytest.skip(f"{cxx} lacks C++20 <barrier>")
    assert r.returncode == 0, r.stderr[-3000:]
    return d


@pytest.mark.parametrize("bits, n_in, n_out, m, target, gs, blocks", [
    (4, 50, 7, 1, None, 0, None), (4, 896, 9, 3, None, 0, None), (4, 4864, 7, 8, None, 0, None),
    (4, 4864, 9, 2, 1, 0, None), (4, 11008, 3, 1, None, 0, None), (3, 96, 9, 1, None, 0, None),
    (3, 4864, 7, 4, None, 0, None), (3, 896, 5, 1, 1, 0, None), (2, 4864, 9, 1, None, 0, None),
    (2, 896, 7, 3, 1, 0, None), (2, 96, 5, 1, None, 0, None), (8, 896, 6, 1, None, 0, None),
    (8, 160, 9, 4, 1, 0, None),
    # per-group scales: groups smaller than a chunk (2 bits: 64 values), equal, larger; padding past in_features
    (4, 896, 9, 1, None, 32, None), (4, 4864, 7, 2, 1, 128, None), (2, 896, 7, 1, 1, 32, None),
    (2, 96, 5, 4, None, 32, None), (2, 4864, 6, 4, None, 64, None), (3, 4864, 5, 1, None, 64, None),
    (3, 768, 9, 2, 1, 256, None), (8, 896, 6, 1, None, 32, None), (4, 2048, 13, 8, None, 256, None),
    # more row sets than threadgroups: the grid-stride loop over row sets (the next row set's first
    # chunk is requested during the current one's last), with KS = 1 and KS > 1, 2/3/4 bits
    # (256-thread threadgroups with pair tables: 8 row sets of 4 rows each, so > 32 rows per threadgroup)
    (4, 896, 77, 1, 1, 0, 2), (4, 512, 101, 2, 1, 128, 3), (3, 4864, 71, 2, None, 0, 2),
    (2, 896, 101, 1, 1, 32, 3), (4, 11008, 23, 1, None, 0, 2), (4, 50, 77, 3, None, 0, 2),
])
def test_kernel_body_on_cpu_host_dialect(host_kernel, monkeypatch, bits, n_in, n_out, m, target, gs, blocks):
    if target is not None:  # force KS = 1 (many iterations per warp) on a small layer
        monkeypatch.setattr(qmv, "TARGET_WARPS", target)
    if blocks is not None:
        monkeypatch.setattr(qmv, "MAX_BLOCKS", blocks)
    _host_check(host_kernel, bits, n_in, n_out, m, gs, blocks=blocks)


@pytest.mark.parametrize("bits, n_in, n_out, m, target, gs, blocks", [
    (4, 896, 9, 1, None, 0, None), (4, 4864, 7, 2, 1, 0, None), (3, 4864, 7, 1, None, 64, None), (2, 896, 7, 3, 1, 0, None),
    (4, 896, 45, 1, 1, 0, 2), (4, 11008, 3, 1, None, 0, None), (2, 96, 5, 4, None, 32, None), (4, 50, 7, 8, None, 0, None),
])
def test_kernel_body_two_rows_per_warp_on_cpu(host_kernel_r2, monkeypatch, bits, n_in, n_out, m, target, gs, blocks):
    if target is not None:
        monkeypatch.setattr(qmv, "TARGET_WARPS", target)
    if blocks is not None:
        monkeypatch.setattr(qmv, "MAX_BLOCKS", blocks)
    _host_check(host_kernel_r2, bits, n_in, n_out, m, gs, blocks=blocks, rows=2, lut=1)


@pytest.mark.parametrize("bits, n_in, n_out, m, target, gs, blocks", [
    (4, 50, 7, 1, None, 0, None), (4, 896, 9, 3, None, 0, None), (4, 4864, 9, 2, 1, 0, None), (3, 96, 9, 1, None, 0, None),
    (3, 4864, 7, 4, None, 0, None), (3, 896, 5, 1, 1, 0, None), (2, 4864, 9, 1, None, 0, None), (2, 896, 7, 3, 1, 0, None),
    (4, 896, 9, 1, None, 32, None), (2, 896, 7, 1, 1, 32, None), (3, 768, 9, 2, 1, 256, None), (2, 4864, 6, 4, None, 64, None),
    (4, 896, 77, 1, 1, 0, 2), (3, 4864, 71, 2, None, 0, 2), (2, 896, 101, 1, 1, 32, 3), (4, 11008, 23, 1, None, 0, 2),
    (4, 4864, 7, 8, None, 0, None),  # M = 8: the ring, so revision 6's lookups even when pair tables are asked for
])
def test_kernel_body_pair_tables_on_cpu(host_kernel_lut, monkeypatch, bits, n_in, n_out, m, target, gs, blocks):
    if target is not None:
        monkeypatch.setattr(qmv, "TARGET_WARPS", target)
    if blocks is not None:
        monkeypatch.setattr(qmv, "MAX_BLOCKS", blocks)
    _host_check(host_kernel_lut, bits, n_in, n_out, m, gs, blocks=blocks, lut=1)


def _sylvester(b):
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return h


def _host_check(host_kernel, bits, n_in, n_out, m, gs, rotation=None, splits=None, blocks=None, rows=None, lut=None):
    ops = None if rotation is None else qmv.rotation_operands(rotation)
    a = 1 if ops is None else ops[1].shape[0]
    xcap = 0
    if ops is not None:
        need = qmv.prologue_floats(bits, n_in, m, a)
        xcap = next(c for c in qmv.XCAP_BUCKETS if c >= need)
    qmv.launch_spec.cache_clear()
    try:
        spec = _spec(n_in, n_out, m, bits, mx.float32, bias=True, group_size=gs or None, xcap=xcap, splits=splits,
                     rows=rows, lut=lut)
    finally:
        qmv.launch_spec.cache_clear()
    (gx, ks, rw), mt = spec["grid"], spec["template"][4][1]
    assert spec["template"][6] == ("XCAP", xcap)
    if blocks is not None:
        assert gx // 32 == blocks and blocks * rw * spec["template"][9][1] < n_out
    packed, scales, levels, bias = _weights(bits, n_in, n_out, group_size=gs or None)
    rng = np.random.default_rng(n_in + bits)
    din = n_in if ops is not None else spec["padded_in"]  # the prologue pads in shared memory itself
    x = np.zeros((m, din), np.float32)
    x[:, :n_in] = rng.standard_normal((m, n_in))
    rs = np.array(ops[0]) if ops is not None else np.zeros(1, np.float32)
    rl = np.array(ops[1]) if ops is not None else np.zeros((1, 1), np.float32)
    with open(host_kernel / "in.bin", "wb") as f:
        for arr in (x, packed, scales, levels, bias, rs, rl):
            f.write(np.ascontiguousarray(arr, dtype=np.uint32 if arr is packed else np.float32).tobytes())
    g = scales.shape[1] if scales.ndim == 2 else 1
    seg = list(splits) + [n_out] * (2 - len(splits)) if splits else [n_out, n_out]
    args = [bits, mt, gs, xcap, m, din, n_out, packed.shape[1], ks, rw, gx // 32, 1, g, a, *seg, "in.bin", "out.bin"]
    subprocess.run(["./k", *map(str, args)], cwd=host_kernel, check=True, timeout=120)
    raw = np.fromfile(host_kernel / "out.bin", np.float32)
    ends = [0] + seg + [n_out]
    parts = [raw[m * ends[k]: m * ends[k + 1]].reshape(m, ends[k + 1] - ends[k]) for k in range(3)]
    got = np.concatenate(parts, axis=1)  # each output is [m, its rows]; back to [m, n_out]
    xin = x[:, :n_in].astype(np.float64)
    xerr = None
    if ops is not None:  # R = (L (x) S_B / sqrt(B)) diag(sd), from the float32 operands the kernel read
        lm = rl.astype(np.float64)
        big = np.kron(lm, _sylvester(n_in // a) / np.sqrt(n_in // a)) * rs.astype(np.float64)[None, :]
        xerr = (np.log2(n_in // a) + a + 3) * 2.0**-24 * (np.abs(xin) @ np.abs(big).T)
        xin = xin @ big.T
    y, tol = _reference64(mx.array(xin.astype(np.float32)), packed, scales, levels, mx.array(bias), bits, gs or None,
                          x64=xin, xerr=xerr)
    assert np.all(np.abs(got - y) <= tol), np.abs(got - y).max()


@pytest.mark.parametrize("kind, n_in, bits, n_out, m, gs, splits", [
    ("hadamard", 896, 4, 37, 1, 0, None), ("hadamard", 896, 4, 1152, 1, 0, (896, 1024)),
    ("kron", 1472, 4, 9, 1, 0, None), ("hadamard", 4096, 4, 13, 1, 0, (5,)), ("hadamard", 768, 3, 11, 1, 0, None),
    ("kron", 1472, 2, 7, 2, 64, (3, 5)), ("hadamard", 96, 4, 5, 1, 32, None), ("hadamard", 1024, 4, 9, 2, 0, (4,)),
    ("hadamard", 256, 2, 6, 1, 0, None), ("kron", 320, 8, 6, 2, 0, None), ("hadamard", 1536, 4, 21, 2, 0, (8, 16)),
    # 8 bits, 48 inputs: a row of 48 staged floats is 16 mod 32, two rows must not overlap
    ("hadamard", 48, 8, 7, 2, 0, None), ("hadamard", 80, 8, 5, 3, 0, (2,)),
])
def test_kernel_prologue_rotation_and_outputs_on_cpu(host_kernel, kind, n_in, bits, n_out, m, gs, splits):
    from vqpipe.codec.rotation import make_rotation

    _host_check(host_kernel, bits, n_in, n_out, m, gs, make_rotation(kind, n_in, seed=5), splits)


@pytest.mark.parametrize("kind, n_in, bits, n_out, m, splits, blocks", [
    ("hadamard", 896, 4, 61, 1, (20, 40), 2), ("kron", 1472, 4, 37, 1, None, 3), ("hadamard", 768, 3, 45, 1, (9,), 2),
    ("hadamard", 1024, 2, 70, 1, None, 3),
])
def test_kernel_prologue_with_grid_stride_on_cpu(host_kernel, monkeypatch, kind, n_in, bits, n_out, m, splits, blocks):
    from vqpipe.codec.rotation import make_rotation

    monkeypatch.setattr(qmv, "MAX_BLOCKS_ROT", blocks)  # each threadgroup rotates once, then takes row sets
    _host_check(host_kernel, bits, n_in, n_out, m, 0, make_rotation(kind, n_in, seed=3), splits, blocks=blocks)


def test_prologue_operands_reproduce_the_rotation():
    from vqpipe.codec.rotation import make_rotation

    for kind, d in (("hadamard", 896), ("kron", 4864), ("hadamard", 4096), ("kron", 1472), ("hadamard", 768)):
        r = make_rotation(kind, d, seed=2)
        sd, lm = (np.array(a, np.float64) for a in qmv.rotation_operands(r))
        b = d // lm.shape[0]
        want = np.array(r.apply(mx.eye(d)), np.float64).T  # column i: R e_i
        assert np.abs(np.kron(lm, _sylvester(b) / np.sqrt(b)) * sd[None, :] - want).max() < 1e-6
    assert qmv.rotation_operands(make_rotation("qr", 64, seed=1)) is None
    assert qmv.rotation_operands(make_rotation("none", 64)) is None
