"""vqpipe/kernels/nvrtc.py: where the library and headers are looked for (CPU, no NVRTC needed), compiling
to PTX and cubin where NVRTC is found, and on a CUDA GPU both of its callers' launch paths: a cubin
through the driver (experiments/cuda_time.py) and PTX through mx.fast.precompiled_cuda_kernel."""

import ctypes
import os

import mlx.core as mx
import numpy as np
import pytest

from vqpipe.kernels import nvrtc

KERNEL = """#include <cuda_fp16.h>
extern "C" __global__ void add_half(const __half* x, __half* out, const int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __hadd(x[i], __float2half(1.0f));
}
"""


def _have_nvrtc():
    try:
        nvrtc.include_dir()
    except RuntimeError:
        return False
    return True


def _cuda():
    return mx.cuda.is_available() if hasattr(mx, "cuda") else False


def _touch(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").close()
    return str(path)


def test_library_files_wheel_first_never_alt_or_builtins(tmp_path, monkeypatch):
    lib = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    want = _touch(lib / "libnvrtc.so.13")
    for other in ("libnvrtc.alt.so.13", "libnvrtc-builtins.so.13.0"):
        _touch(lib / other)
    home = _touch(tmp_path / "cuda" / "lib64" / "libnvrtc.so.13")
    monkeypatch.setattr("sys.path", [str(tmp_path / "site")])
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert list(nvrtc._library_files())[:2] == [want, home]


def test_no_library_names_where_it_looked(tmp_path, monkeypatch):
    _touch(tmp_path / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13")  # not a library: skipped, not fatal
    monkeypatch.setattr("sys.path", [str(tmp_path)])
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    monkeypatch.setattr(nvrtc, "_SONAMES", ("libnvrtc-vqpipe-missing.so.13",))
    monkeypatch.setattr(nvrtc, "_homes", lambda: [str(tmp_path / "nowhere")])
    nvrtc.library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="NVRTC not found.*nowhere.*libnvrtc-vqpipe-missing"):
            nvrtc.library()
    finally:
        nvrtc.library.cache_clear()


def test_headers_from_the_library_toolkit_first(tmp_path, monkeypatch):
    wheel = tmp_path / "nvidia" / "cu13"
    _touch(wheel / "include" / "cuda_fp16.h")
    _touch(tmp_path / "cuda" / "include" / "cuda_fp16.h")
    monkeypatch.setattr(nvrtc, "_homes", lambda: [str(tmp_path / "cuda")])
    monkeypatch.setattr(nvrtc, "library", lambda: (None, str(wheel / "lib")))
    assert nvrtc.include_dir() == str(wheel / "include")
    monkeypatch.setattr(nvrtc, "library", lambda: (None, None))  # loaded by soname: the toolkit's
    assert nvrtc.include_dir() == str(tmp_path / "cuda" / "include")
    monkeypatch.setattr(nvrtc, "_homes", lambda: [])
    with pytest.raises(RuntimeError, match="no CUDA headers"):
        nvrtc.include_dir()


@pytest.mark.skipif(not _have_nvrtc(), reason="no NVRTC library or CUDA headers here")
def test_ptx_and_cubin_and_errors():
    ptx, _ = nvrtc.ptx(KERNEL, "compute_90", name="add")
    assert b".entry add_half(" in ptx and ptx.endswith(b"\0")
    cubin, _ = nvrtc.cubin(KERNEL, "sm_90")
    assert cubin[:4] == b"\x7fELF"
    with pytest.raises(RuntimeError, match="(?s)compile.*undefined_thing"):
        nvrtc.ptx(KERNEL.replace("__hadd", "undefined_thing"), "compute_90")


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs MLX's CUDA backend")
def test_both_callers_launch_on_the_gpu():
    from experiments import cuda_time as ct

    x = np.arange(1000, dtype=np.float16)
    drv = ct.Driver()
    cubin, _ = ct.compile_cubin(KERNEL, "sm_" + mx.device_info()["architecture"].split("_")[1].rstrip("a"))
    fn, _ = drv.load(cubin, "add_half")
    src, dst = drv.upload(x), drv.alloc(x.nbytes)
    drv.launch(fn, (4, 1, 1), (256, 1, 1), [ctypes.c_uint64(src), ctypes.c_uint64(dst), ctypes.c_int(x.size)])
    drv.sync()
    got = drv.download(dst, np.empty_like(x))
    drv.free(src), drv.free(dst)
    assert np.array_equal(got, x + np.float16(1))
    ptx, _ = nvrtc.ptx(KERNEL, "compute_90", name="add")
    out = mx.fast.precompiled_cuda_kernel(name="add_half", compiled_source=ptx, inputs=[mx.array(x)], output_shapes=[x.shape],
                                          output_dtypes=[mx.float16], scalars=[x.size], grid=(1024, 1, 1),
                                          threadgroup=(256, 1, 1))[0]
    assert np.array_equal(np.array(out), x + np.float16(1))
