"""vqpipe.cuda_cache: MLX's module names (source text, std::hash), its cache files, and on CUDA a
second process launching a kernel from the file instead of compiling it."""

import os
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from vqpipe import gpu
from vqpipe.kernels import cuda_cache

needs_cuda = pytest.mark.skipif(gpu.backend() != "cuda", reason="needs MLX's CUDA backend")

HASH_CPP = r"""
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>
int main() {
  std::string s((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  std::printf("%zx\n", std::hash<std::string>{}(s));
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_std_hash_is_libstdcxx(tmp_path):
    (tmp_path / "h.cpp").write_text(HASH_CPP)
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "h"), str(tmp_path / "h.cpp")], check=True)
    rng = np.random.default_rng(0)
    for n in [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 4099]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        want = subprocess.run([str(tmp_path / "h")], input=data, capture_output=True, check=True).stdout
        assert f"{cuda_cache.std_hash(data):x}" == want.decode().strip(), n


def test_kernel_source_is_mlx_build_kernel_text():
    """The text of mlx/backend/cuda/custom_kernel.cpp's build_kernel for one call: shape info only for
    the names the body uses, template arguments as constants, the name with their hash."""
    body = "out[0] = a[a_shape[0]] + b[0] + N;"
    name, text = cuda_cache.kernel_source(
        "k", "// h\n", body, ["a", "b"], [(mx.float32, 2), (mx.uint32, 1)], ["out"], [mx.float16],
        [("T", mx.bfloat16), ("N", 3), ("F", True)])
    assert name == "custom_kernel_k_bfloat16_t_3_t"
    assert text == textwrap.dedent("""
        #include "mlx/backend/cuda/device/utils.cuh"

        #include <cooperative_groups.h>

        // h
        namespace mlx::core::cu {

        namespace cg = cooperative_groups;

        __global__ void custom_kernel_k_bfloat16_t_3_t(
            const float* a,
            const __grid_constant__ Shape a_shape,
            const uint32_t* b,
            __half* out) {
          using T = __nv_bfloat16;
          constexpr int N = 3;
          constexpr bool F = true;

        out[0] = a[a_shape[0]] + b[0] + N;
        }

        } // namespace mlx::core::cu
        """)


def test_ptx_path_splits_long_names_as_mlx(tmp_path):
    assert cuda_cache.ptx_path(tmp_path, "m_1") == tmp_path / "m_1.ptx"
    long = "x" * 300
    assert cuda_cache.ptx_path(tmp_path, long) == tmp_path / ("x" * 245) / ("x" * 55 + ".ptx")


def test_existing_file_is_not_compiled_again(tmp_path, monkeypatch):
    name, text = cuda_cache.kernel_source("k", "", "out[0] = 1;", [], [], ["out"], [mx.float32], [])
    path = cuda_cache.ptx_path(tmp_path, f"{name}_{cuda_cache.std_hash(text.encode()):x}")
    path.write_bytes(b"cubin")

    def compiler():
        raise AssertionError("compiled although the file is there")

    monkeypatch.setattr(cuda_cache, "_compiler", compiler)
    assert cuda_cache.ensure_cached(name, text, tmp_path) == path


def test_without_nvrtc_mlx_compiles_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(cuda_cache._state, "nvrtc", None)
    name, text = cuda_cache.kernel_source("k", "", "out[0] = 1;", [], [], ["out"], [mx.float32], [])
    assert cuda_cache.ensure_cached(name, text, tmp_path) is None
    assert list(tmp_path.iterdir()) == []


CHILD = r"""
import sys, time
import mlx.core as mx, numpy as np
from vqpipe.kernels import qmv
from vqpipe.codec.bitpack import pack
rng = np.random.default_rng(0)
idx = rng.integers(0, 16, (300, 896)).astype(np.uint8)
p, s = mx.array(pack(idx, 4)), mx.array(rng.random(300).astype(np.float32))
c = mx.array(np.sort(rng.standard_normal(16)).astype(np.float32))
x = mx.array(rng.standard_normal((1, 896)).astype(np.float32)).astype(mx.bfloat16)
mx.eval(p, s, c, x)
t = time.perf_counter()
y = qmv.launch("cuda", x, p, s, c, 4)
mx.eval(y)
print(time.perf_counter() - t)
np.save(sys.argv[1], np.array(y.astype(mx.float32)))
"""


@pytest.mark.gpu
@needs_cuda
def test_second_process_loads_the_kernel_instead_of_compiling(tmp_path):
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path / "ptx"))
    first, second = [float(subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / f"y{i}.npy")], env=env,
                                          capture_output=True, text=True, check=True).stdout.split()[-1])
                     for i in (1, 2)]
    files = list((tmp_path / "ptx").rglob("custom_kernel_vqpipe_qmv*.ptx"))
    assert files, "no cache file written"
    assert np.array_equal(np.load(tmp_path / "y1.npy"), np.load(tmp_path / "y2.npy"))
    # NVRTC takes ~1 s per kernel on the H100; loading a cubin takes milliseconds
    assert second < 0.25 < first, (first, second)


def test_unwritable_cache_folder_warns_and_leaves_it_to_mlx(tmp_path, monkeypatch):
    monkeypatch.setitem(cuda_cache._state, "nvrtc", "sm_90a")
    monkeypatch.setattr(cuda_cache, "_compile", lambda text, expression, arch: (b"cubin", "_Z1kv"))
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    name, text = cuda_cache.kernel_source("k", "", "out[0] = 1;", [], [], ["out"], [mx.float32], [])
    with pytest.warns(RuntimeWarning, match="cannot write"):
        assert cuda_cache.ensure_cached(name, text, blocked / "ptx") is None
    ok = cuda_cache.ensure_cached(name, text, tmp_path / "ptx")
    assert ok.read_bytes() == b"cubin"
    assert ok.with_suffix(".txt").read_text() == f"mlx::core::cu::{name}\t_Z1kv\n"
