"""CUDA source to PTX through NVRTC (ctypes), for ``mx.fast.precompiled_cuda_kernel``.

MLX's ``cuda_kernel`` JIT-compiles with NVRTC too, but rebuilds the kernel's whole source string
on every call and hands sizes over as arrays; a precompiled kernel takes its sizes as scalar
arguments and skips the source build (decode_kernel.py, ``launch="precompiled"``). The library is
the one MLX's CUDA backend loads (already in the process there), else the first found on the
library path, in a pip ``nvidia-cuda-nvrtc`` wheel, or under /usr/local/cuda.
"""

import ctypes
import ctypes.util
import functools
import glob
import os
import sys

_SONAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


def _candidates():
    yield from _SONAMES
    found = ctypes.util.find_library("nvrtc")
    if found:
        yield found
    for root in [*sys.path, "/usr/local/cuda"]:
        for pattern in ("nvidia/cu13/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*", "lib64/libnvrtc.so*"):
            yield from sorted(glob.glob(os.path.join(root, pattern)))


@functools.lru_cache(maxsize=1)
def library():
    """The NVRTC library (ctypes.CDLL); RuntimeError naming where it looked when there is none."""
    tried = []
    for name in _candidates():
        if "builtins" in name or ".alt." in name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            tried.append(name)
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise RuntimeError(f"NVRTC not found (tried {', '.join(tried[:8])}, ...)")


def _check(lib, status, what, prog=None):
    if status == 0:
        return
    log = ""
    if prog is not None:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
    raise RuntimeError(f"NVRTC {what}: {lib.nvrtcGetErrorString(status).decode()}\n{log[-4000:]}")


def ptx(source, name, arch="compute_90", options=()):
    """PTX (bytes, NUL-terminated, as the driver loads it) of ``source`` for ``arch``."""
    lib = library()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None), "create")
    try:
        opts = [f"--gpu-architecture={arch}", "-std=c++17", *options]
        arr = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        _check(lib, lib.nvrtcCompileProgram(prog, len(opts), arr), "compile", prog)
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "PTX size")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetPTX(prog, buf), "PTX")
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
