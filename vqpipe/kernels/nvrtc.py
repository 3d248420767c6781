"""CUDA C++ to PTX or cubin with NVRTC, through ctypes: one library lookup, one include rule.

Used where vqpipe compiles CUDA itself: vqpipe/kernels/cuda_cache.py (its kernels' cubins, compiled once per
machine for MLX's JIT cache) and the qmv GPU-time harness (experiments/cuda_time.py, cubins it
launches through the driver). Nothing here needs MLX or a GPU, only the NVRTC library.

The library: NVIDIA's pip wheels on ``sys.path`` (``nvidia/cu13/lib``, the CUDA 13 layout, or
``nvidia/cuda_nvrtc/lib``), then the toolkit (CUDA_HOME, CUDA_PATH, /usr/local/cuda), then the plain
sonames on the loader's path. NVRTC dlopens its builtins library by name when it compiles, which
fails where that folder is not on the loader's path (a wheel's never is): it is loaded first,
globally, from the folder the library came from. The headers (``cuda_fp16.h`` …) are taken from the
same toolkit as the library (``include`` beside its ``lib``/``lib64``), else CUDA_HOME, CUDA_PATH,
/usr/local/cuda, as MLX's JIT looks.
"""

import ctypes
import functools
import glob
import os
import sys

_SONAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


def _homes():
    return [h for h in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if h]


def _library_files():
    """Full paths of NVRTC libraries, most wanted first (never the ``.alt`` builds)."""
    pats = [os.path.join(p, "nvidia", sub, "lib", "libnvrtc.so*") for p in sys.path if p for sub in ("cu13", "cuda_nvrtc")]
    pats += [os.path.join(h, lib, "libnvrtc.so*") for h in _homes() for lib in ("lib64", "lib")]
    for pat in pats:
        for f in sorted(glob.glob(pat), key=len, reverse=True):
            if "builtins" not in f and ".alt." not in f:
                yield f


@functools.lru_cache(maxsize=1)
def library():
    """(ctypes.CDLL, the folder it came from or None); RuntimeError naming where it looked."""
    for f in _library_files():
        folder = os.path.dirname(f)
        builtins = [b for b in glob.glob(os.path.join(folder, "libnvrtc-builtins.so*")) if ".alt." not in b]
        try:
            if builtins:
                ctypes.CDLL(max(builtins, key=len), mode=ctypes.RTLD_GLOBAL)
            return _typed(ctypes.CDLL(f)), folder
        except OSError:  # a broken or foreign-architecture file: try the next one
            continue
    for name in _SONAMES:  # on the loader's path, or already loaded by the process under that name
        try:
            return _typed(ctypes.CDLL(name)), None
        except OSError:
            continue
    raise RuntimeError("NVRTC not found: no nvidia/cu13/lib or nvidia/cuda_nvrtc/lib on sys.path, none under "
                       f"{', '.join(_homes())}, and none of {', '.join(_SONAMES)} on the loader's path")


def _typed(lib):
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def include_dir():
    """The CUDA headers' folder: the library's own toolkit, else CUDA_HOME, CUDA_PATH, /usr/local/cuda."""
    _, folder = library()
    near = [os.path.join(os.path.dirname(folder), "include")] if folder else []
    for d in near + [os.path.join(h, "include") for h in _homes()]:
        if os.path.exists(os.path.join(d, "cuda_fp16.h")):
            return d
    raise RuntimeError(f"NVRTC: no CUDA headers (cuda_fp16.h) beside the library ({folder}) or under {', '.join(_homes())}")


def include_args(extra=()):
    """``--include-path`` options: the CUDA headers, their CCCL folder (``cuda/std/...``) where the
    toolkit keeps it apart, and ``extra`` folders that exist."""
    base = include_dir()
    dirs = [base, os.path.join(base, "cccl"), *extra]
    return [f"--include-path={d}" for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _check(lib, status, what, prog=None):
    if status == 0:
        return
    raise RuntimeError(f"NVRTC {what}: {lib.nvrtcGetErrorString(status).decode()}\n{_log(lib, prog)[-4000:]}")


def _log(lib, prog):
    if prog is None:
        return ""
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    return buf.value.decode(errors="replace")


def build(source, arch, options=(), binary="cubin", name="k", expressions=()):
    """(bytes, log) of ``source`` compiled for ``arch`` ("sm_90", "compute_90", …): ``binary`` "cubin"
    (needs an sm_ arch) or "ptx" (NUL-terminated, as the driver loads it); C++17, the include rule.
    With ``expressions`` (kernel names), (bytes, log, their mangled names)."""
    get = {"cubin": ("nvrtcGetCUBINSize", "nvrtcGetCUBIN"), "ptx": ("nvrtcGetPTXSize", "nvrtcGetPTX")}[binary]
    lib, _ = library()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None), "create")
    try:
        for e in expressions:
            _check(lib, lib.nvrtcAddNameExpression(prog, e.encode()), "name expression")
        opts = [f"--gpu-architecture={arch}", "-std=c++17", *include_args(), *options]
        arr = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        _check(lib, lib.nvrtcCompileProgram(prog, len(opts), arr), "compile", prog)
        size = ctypes.c_size_t()
        _check(lib, getattr(lib, get[0])(prog, ctypes.byref(size)), get[0])
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, getattr(lib, get[1])(prog, buf), get[1])
        if not expressions:
            return buf.raw, _log(lib, prog)
        lowered = []
        for e in expressions:
            m = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, e.encode(), ctypes.byref(m)), "lowered name")
            lowered.append(m.value.decode())
        return buf.raw, _log(lib, prog), lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def ptx(source, arch="compute_90", options=(), name="k"):
    """(PTX bytes, log): :func:`build` to PTX."""
    return build(source, arch, options, "ptx", name)


def cubin(source, arch="sm_90a", options=(), name="k"):
    """(cubin bytes, log): :func:`build` to a cubin."""
    return build(source, arch, options, "cubin", name)
