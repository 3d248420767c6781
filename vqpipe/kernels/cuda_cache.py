"""vqpipe's CUDA kernels compiled once per machine instead of once per process.

MLX 0.32.4 compiles every ``mx.fast.cuda_kernel`` with NVRTC in every new process: its JIT module
cache reads compiled code from disk for all kernels but writes it only for MLX's own
(``get_jit_module(..., use_disk_cache=false)`` in mlx/backend/cuda/custom_kernel.cpp). On an H100
(docs/results/2026-12-06-h100-user) that was 8-10 s before the first decode step of a 0.5B
reservoir in every process, MLX's own kernels being on disk already.

:func:`cuda_kernel` wraps ``mx.fast.cuda_kernel``. Before a kernel's first launch in a process it
makes sure the file MLX looks for exists (``MLX_PTX_CACHE_DIR``, default ``<tmp>/mlx/<version>/ptx``:
``<module name>.ptx`` holding a cubin, ``.txt`` the kernel's mangled name), compiling the kernel
once with NVRTC when it is missing; MLX then loads it as it loads its own kernels, and launches
stay MLX's. The module name is MLX's: the kernel's name and template arguments and libstdc++'s
``std::hash`` of the source text MLX builds (:func:`kernel_source` writes the same text). Where
the text or the hash differ from MLX's (another MLX version), nothing breaks: MLX misses the file
and compiles as before. Where NVRTC or the CUDA headers cannot be found, the same, with one warning.
"""

import contextlib
import ctypes
import os
import tempfile
import warnings
from pathlib import Path

import mlx.core as mx

from . import nvrtc

# MLX's text around a kernel (mlx/backend/cuda/custom_kernel.cpp, build_kernel), byte for byte
_UTILS = '#include "mlx/backend/cuda/device/utils.cuh"'
_HEAD = f"\n{_UTILS}\n\n#include <cooperative_groups.h>\n\n"
_OPEN = "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
_CLOSE = "\n}\n\n} // namespace mlx::core::cu\n"
_CTYPE = {
    mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
    mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double",
}
_TYPE_STRING = {**_CTYPE, mx.float16: "float16_t", mx.bfloat16: "bfloat16_t"}  # MLX's get_type_string
# Compiled in place of MLX's utils.cuh (its text lives inside libmlx): the types vqpipe's kernels
# use, and Shape/Strides laid out as MLX passes them (MAX_NDIM from MLX's device/config.h).
_PREAMBLE = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/array>
#include <cuda/std/cstdint>
#define MAX_NDIM 10
#define WARP_SIZE 32
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
"""
_M64 = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def std_hash(data):
    """libstdc++'s ``std::hash<std::string>`` of ``data`` (bytes) with a 64-bit size_t
    (``_Hash_bytes``, seed 0xc70f6907): the hash in MLX's module names."""
    def mix(v):
        return v ^ (v >> 47)

    n = len(data)
    h = 0xC70F6907 ^ (n * _MUL & _M64)
    whole = n & ~7
    for w in memoryview(data[:whole]).cast("Q").tolist():
        h = (h ^ (mix(w * _MUL & _M64) * _MUL & _M64)) * _MUL & _M64
    if n & 7:
        h = (h ^ int.from_bytes(data[whole:], "little")) * _MUL & _M64
    return mix(mix(h) * _MUL & _M64)


def _targ(value):
    if isinstance(value, bool):
        return "_t" if value else "_f"
    if isinstance(value, int):
        return f"_{value}"
    return "_" + _TYPE_STRING[value]


def kernel_source(name, header, source, input_names, inputs, output_names, output_dtypes, template):
    """(kernel name, source text) as MLX's ``cuda_kernel`` builds them for one call; ``inputs`` are
    (dtype, ndim) pairs."""
    kname = "custom_kernel_" + name + "".join(_targ(v) for _, v in template)
    params = []
    for n, (dtype, ndim) in zip(input_names, inputs):
        params.append(f"    const {_CTYPE[dtype]}* {n},\n")
        if ndim > 0:
            if n + "_shape" in source:
                params.append(f"    const __grid_constant__ Shape {n}_shape,\n")
            if n + "_strides" in source:
                params.append(f"    const __grid_constant__ Strides {n}_strides,\n")
            if n + "_ndim" in source:
                params.append(f"    const __grid_constant__ int {n}_ndim,\n")
    params.append(",\n".join(f"    {_CTYPE[d]}* {n}" for n, d in zip(output_names, output_dtypes)) + ") {\n")
    consts = []
    for k, v in template:
        if isinstance(v, bool):
            consts.append(f"  constexpr bool {k} = {'true' if v else 'false'};\n")
        elif isinstance(v, int):
            consts.append(f"  constexpr int {k} = {v};\n")
        else:
            consts.append(f"  using {k} = {_CTYPE[v]};\n")
    body = "".join(consts) + ("\n" if consts else "") + source
    return kname, _HEAD + header + _OPEN + f"__global__ void {kname}(\n" + "".join(params) + body + _CLOSE


def cache_dir():
    """MLX's PTX cache folder (mlx/backend/cuda/jit_module.cpp, ptx_cache_dir)."""
    d = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(d) if d else Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def ptx_path(directory, module_name):
    """Where MLX looks for a module (names over 245 characters are split into folders, as MLX does)."""
    path, rest = Path(directory), module_name
    while len(rest) > 245:
        path, rest = path / rest[:245], rest[245:]
    return path / (rest + ".ptx")


def _arch():
    """The device's SASS target, as MLX's JIT names it ("sm_90a" on an H100), from the CUDA driver."""
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0) \
            or cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) \
            or cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev):
        raise OSError("the CUDA driver gave no device")
    return f"sm_{major.value}{minor.value}{'a' if major.value >= 9 else ''}"


def _compile(text, expression, arch):
    """(cubin, mangled name of ``expression``): the text with our preamble for MLX's utils.cuh, the
    options MLX's JIT gives (CCCL: MLX's bundled copy first, as its JIT takes it)."""
    cubin, _, (mangled,) = nvrtc.build(
        text.replace(_UTILS, _PREAMBLE, 1), arch, expressions=[expression],
        options=["--device-as-default-execution-space", f"--include-path={Path(mx.__file__).parent / 'include' / 'cccl'}"])
    return cubin, mangled


_state = {}  # the one _Nvrtc of the process (or the reason there is none)


def _compiler():
    """The device's arch where NVRTC, the CUDA headers and a device are there; else None (one warning)."""
    if "nvrtc" not in _state:
        try:
            nvrtc.include_dir()
            _state["nvrtc"] = _arch()
        except (OSError, RuntimeError) as e:
            _state["nvrtc"] = None
            warnings.warn(f"vqpipe: CUDA kernels compile in every process ({e})", RuntimeWarning, stacklevel=4)
    return _state["nvrtc"]


def ensure_cached(kname, text, directory=None):
    """Write MLX's cache files for this kernel when missing; returns the .ptx path, or None where it
    could not (no NVRTC; the kernel does not compile here: MLX will then say why)."""
    path = ptx_path(directory or cache_dir(), f"{kname}_{std_hash(text.encode()):x}")
    if path.is_file():
        return path
    arch = _compiler()
    if arch is None:
        return None
    expression = "mlx::core::cu::" + kname
    try:
        cubin, mangled = _compile(text, expression, arch)
    except RuntimeError as e:
        warnings.warn(f"vqpipe: {kname} left to MLX's compile ({e})", RuntimeWarning, stacklevel=3)
        return None
    # the names first, then the code under a temporary name renamed into place: MLX reads the .txt
    # once it sees the .ptx, and a concurrent process never sees half a file
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".txt").write_text(f"{expression}\t{mangled}\n")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    except OSError as e:  # a read-only or full cache folder: MLX compiles, as without this module
        with contextlib.suppress(OSError):  # no half-written file left behind (MLX reads only the .ptx name)
            tmp.unlink()
        warnings.warn(f"vqpipe: cannot write {path} ({e}); {kname} compiles in every process",
                      RuntimeWarning, stacklevel=3)
        return None
    return path


class Kernel:
    """``mx.fast.cuda_kernel(...)`` whose compiled code outlives the process (module docstring)."""

    def __init__(self, name, input_names, output_names, source, header=""):
        self.spec = (name, header, source, list(input_names), list(output_names))
        self.kernel = mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names,
                                          source=source, header=header)
        self.seen = set()

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, **kwargs):
        template = template or ()
        key = (tuple(template), tuple((a.dtype, a.ndim) for a in inputs), tuple(output_dtypes))
        if key not in self.seen:
            self.seen.add(key)
            name, header, source, ins, outs = self.spec
            ensure_cached(*kernel_source(name, header, source, ins, key[1], outs, output_dtypes, template))
        return self.kernel(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes, grid=grid,
                           threadgroup=threadgroup, template=list(template), **kwargs)


def cuda_kernel(name, input_names, output_names, source, header=""):
    """The drop-in for ``mx.fast.cuda_kernel`` that vqpipe's CUDA kernels are made with."""
    return Kernel(name, input_names, output_names, source, header)
