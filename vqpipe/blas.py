"""Which BLAS MLX's CPU backend uses, and how vqpipe chooses it on Linux.

MLX's Linux CPU wheel bundles the Netlib reference BLAS (``mlx_cpu.libs/libblas-*.so``), whose fp32
GEMM runs at a few GFLOP/s. libmlx binds ``cblas_sgemm`` & co. through the global symbol scope first,
so preloading Debian's OpenBLAS (package ``libopenblas0-pthread``) makes every MLX matmul run on
OpenBLAS instead; see docs/blas.md for the measured difference.

Policy, from the environment variable ``VQPIPE_BLAS``:

- ``auto`` (default): ``openblas`` on Linux when Debian's OpenBLAS is installed, else ``reference``.
- ``openblas``: require it (error when it is not installed).
- ``reference``: the wheel's bundled BLAS.

A library cannot be preloaded into a running process, so the BLAS is decided at one boundary, the
environment a process starts in: the Snakefile sets it for every job, the Makefile for the tests,
``source scripts/env.sh`` (``python -m vqpipe.blas --exports``) for a shell, and the ``vqpipe``
command starts itself again under the policy's environment when it was started under another
(vqpipe/__main__.py). ``in_use()`` reports what this process really binds to; every artifact records it, validate
refuses to compare across setups (vqpipe/numerics.py) and ``vqpipe.load`` warns (``warn_if_other``).

This module must not import mlx at import time: the Snakefile imports it.
"""

import argparse
import ctypes
import os
import sys
import sysconfig
import warnings

CHOICES = ("auto", "openblas", "reference")


def _multiarch():
    return sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"


def openblas_libs():
    """Debian's OpenBLAS (pthread flavour): the BLAS and LAPACK libraries to preload."""
    d = f"/usr/lib/{_multiarch()}/openblas-pthread"
    return (f"{d}/libblas.so.3", f"{d}/liblapack.so.3")


def openblas_available():
    return sys.platform.startswith("linux") and all(os.path.exists(p) for p in openblas_libs())


def choice(env=None):
    """Resolve ``VQPIPE_BLAS`` to the setup to run: 'openblas', 'reference' or, on macOS, 'accelerate'."""
    env = os.environ if env is None else env
    want = env.get("VQPIPE_BLAS", "auto").strip().lower() or "auto"
    if want not in CHOICES:
        raise ValueError(f"VQPIPE_BLAS={want!r}: choose one of {', '.join(CHOICES)}")
    if sys.platform == "darwin":
        return "accelerate"  # MLX links Accelerate on macOS; nothing to choose
    if want == "reference":
        return "reference"
    if openblas_available():
        return "openblas"
    if want == "openblas":
        raise RuntimeError(
            f"VQPIPE_BLAS=openblas but {openblas_libs()[0]} is missing "
            "(install libopenblas0-pthread, e.g. via scripts/setup.sh)"
        )
    return "reference"


def _split_preload(value):
    return [p for p in value.replace(" ", ":").split(":") if p]


def preloaded(env=None):
    """The setup an environment's ``LD_PRELOAD`` gives a new process: 'openblas' or 'reference'."""
    env = os.environ if env is None else env
    entries = _split_preload(env.get("LD_PRELOAD", ""))
    return "openblas" if all(p in entries for p in openblas_libs()) else "reference"


def env_for(setup, env=None):
    """A copy of ``env`` whose processes run MLX on ``setup`` ('openblas' or 'reference')."""
    out = dict(os.environ if env is None else env)
    if setup not in ("openblas", "reference"):
        raise ValueError(f"unknown BLAS setup {setup!r}")
    ours = set(openblas_libs())
    keep = [p for p in _split_preload(out.get("LD_PRELOAD", "")) if p not in ours]
    if setup == "openblas":
        keep = list(openblas_libs()) + keep
    if keep:
        out["LD_PRELOAD"] = ":".join(keep)
    else:
        out.pop("LD_PRELOAD", None)
    out["VQPIPE_BLAS"] = setup
    if "OPENBLAS_CORETYPE" not in out and _has_avx512():
        out["OPENBLAS_CORETYPE"] = AVX512_CORE
    return out


# OpenBLAS picks its kernels by CPU model, and Debian 12's 0.3.21 does not know AMD family 26
# (Zen 5): it falls back to Haswell, whose sgemm rounds differently depending on the matrix's
# width (a product split in columns or rows is not the same bytes; measured 2026-12-03), which
# broke thread-count and fused-vs-unfused bit-identity, and runs at half the speed (112 against
# 222 GFLOP/s, 1024^3 fp32, one thread). Any CPU with AVX-512 gets the SkylakeX kernels, which
# are width-invariant, so artifacts are the same bytes on every such machine. Applies to numpy's
# own OpenBLAS too (GPTQ runs there). An OPENBLAS_CORETYPE already set is kept.
AVX512_CORE = "SkylakeX"
_AVX512_FLAGS = {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}


def width_invariant():
    """Whether this process's products (numpy's BLAS and MLX's) give a column block of a product the
    same bytes as the product of those columns alone; OpenBLAS's Haswell kernels do not, so results
    that differ only in how a product is split (fused vs separate projections, row chunks) are equal
    to rounding there, not in bytes."""
    import mlx.core as mx
    import numpy as np

    r = np.random.default_rng(0)
    a, b = r.standard_normal((32, 16), dtype=np.float32), r.standard_normal((16, 21), dtype=np.float32)
    ok = np.array_equal((a @ b)[:, :7], a @ b[:, :7]) and np.array_equal((a @ b)[:11], a[:11] @ b)
    whole = np.array(mx.array(a) @ mx.array(b))
    return ok and np.array_equal(whole[:, :7], np.array(mx.array(a) @ mx.array(b[:, :7])))


def _has_avx512(cpuinfo="/proc/cpuinfo"):
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return _AVX512_FLAGS <= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return False


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _global_definition(symbol):
    """Path of the library defining ``symbol`` in the global scope, which wins MLX's binding."""
    glob = ctypes.CDLL(None)
    try:
        fn = getattr(glob, symbol)
    except AttributeError:
        return None
    try:
        dladdr = glob.dladdr
    except AttributeError:  # glibc < 2.34 keeps it in libdl
        dladdr = ctypes.CDLL("libdl.so.2").dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def _mapped_blas():
    """BLAS/LAPACK-looking libraries mapped into this process (Linux), in address order."""
    seen = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else ""
                name = os.path.basename(path).lower()
                if path.startswith("/") and any(k in name for k in ("blas", "lapack", "mkl", "blis")):
                    if path not in seen:
                        seen.append(path)
    except OSError:
        pass
    return seen


def _classify(path):
    real = os.path.realpath(path).lower()
    name = os.path.basename(real)
    if "openblas" in real:
        return "openblas"
    if "mkl" in name:
        return "mkl"
    if "blis" in name:
        return "blis"
    if name.startswith("libblas"):
        return "reference"  # the wheel's bundled copy or Debian's netlib libblas3
    return name


def _openblas_details():
    glob = ctypes.CDLL(None)
    out = {}
    try:
        f = glob.openblas_get_config
        f.restype = ctypes.c_char_p
        out["config"] = f().decode().strip()
        out["threads"] = int(glob.openblas_get_num_threads())
    except AttributeError:
        pass
    return out


# (set, get) symbol names of the OpenBLAS builds we meet: Debian's (preloaded for MLX, above)
# and numpy's wheel (scipy-openblas, 64-bit integers and a symbol suffix).
OPENBLAS_THREADS = [("openblas_set_num_threads", "openblas_get_num_threads"),
             ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
             ("openblas_set_num_threads64_", "openblas_get_num_threads64_")]


def set_threads(n):
    """Set every OpenBLAS loaded in this process to ``n`` threads; [(setter, previous count)]."""
    import numpy  # noqa: F401  (loads numpy's OpenBLAS, so its symbols can be found)

    libs = [ctypes.CDLL(None)]
    try:
        from numpy._core import _multiarray_umath as umath

        libs.append(ctypes.CDLL(umath.__file__))
    except (ImportError, OSError):
        pass
    done, seen = [], set()
    for lib in libs:
        for set_name, get_name in OPENBLAS_THREADS:
            try:
                setter, getter = getattr(lib, set_name), getattr(lib, get_name)
            except AttributeError:
                continue
            if ctypes.cast(setter, ctypes.c_void_p).value in seen:
                continue
            seen.add(ctypes.cast(setter, ctypes.c_void_p).value)
            setter.argtypes, getter.restype = [ctypes.c_int], ctypes.c_int
            old = getter()
            setter(n)
            done.append((setter, old))
    return done


def in_use():
    """Which BLAS MLX's CPU matmuls call in this process: ``{"name", "path", "preloaded", ...}``."""
    import mlx.core  # noqa: F401  (load libmlx and its BLAS before looking)

    if sys.platform == "darwin":
        return {"name": "accelerate", "path": None, "preloaded": False, "policy": "accelerate"}
    mapped = _mapped_blas()
    path = _global_definition("cblas_sgemm")
    if path is None:
        # Not in the global scope: libmlx resolves it from its own dependencies (the bundled copy).
        path = next((p for p in mapped if os.path.basename(p).startswith("libblas")), None)
    info = {
        "name": _classify(path) if path else "unknown",
        "path": path,
        "preloaded": preloaded() == "openblas",
        "policy": os.environ.get("VQPIPE_BLAS", "auto"),
        "mapped": mapped,
        "threads_env": {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS") if k in os.environ},
    }
    if info["name"] == "openblas":
        info.update(_openblas_details())
    return info


def apply(setup, environ=None):
    """Set ``environ`` (default: this process's) so processes started from now on run ``setup``."""
    environ = os.environ if environ is None else environ
    new = env_for(setup, environ) if setup in ("openblas", "reference") else {**environ, "VQPIPE_BLAS": setup}
    if "LD_PRELOAD" not in new:
        environ.pop("LD_PRELOAD", None)
    environ.update(new)


def prepend_path(directory, environ=None):
    """Put ``directory`` first on ``environ``'s PATH (where jobs find ``python``)."""
    environ = os.environ if environ is None else environ
    environ["PATH"] = f"{directory}{os.pathsep}{environ.get('PATH', '')}"


def policy_mismatch():
    """A sentence when this process's BLAS is not the one the policy asks for, else None.

    Only what the environment would preload is compared (no mlx import): call it at start-up.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        want = choice()
    except (ValueError, RuntimeError) as e:
        return str(e)
    have = preloaded()
    if want == have:
        return None
    return (f"VQPIPE_BLAS={os.environ.get('VQPIPE_BLAS', 'auto')} asks for {want}, but this process "
            f"runs the {have} BLAS (LD_PRELOAD decides it when the process starts): "
            "run `source scripts/env.sh` or `eval \"$(python -m vqpipe.blas --exports)\"` first")


def warn_if_other(recorded, what):
    """Warn when ``recorded`` (an artifact's environment record) used another BLAS than this process.

    Only the BLAS is a difference a user can act on (``VQPIPE_BLAS``; the ``vqpipe`` command starts
    under the policy's); another thread count, device or MLX version moves some logits in the last
    bits too, which validate checks and a user of the model cannot change. Results still load.
    """
    import mlx.core as mx

    from . import numerics

    dev = mx.default_device()
    here = {"backend": "gpu" if dev.type == mx.gpu else "cpu", "device": str(dev), "blas": in_use(),
            "versions": {"mlx": mx.__version__}}
    diff = numerics.differences(recorded, here, ("artifact", "here"), keys=(("blas", "name"),))
    if diff:
        made = numerics.setup(recorded, (("blas", "name"),))["blas.name"]
        hint = f" (VQPIPE_BLAS={made} gives its setup)" if made in ("openblas", "reference") else ""
        warnings.warn(f"{what} was made under another BLAS ({'; '.join(diff)}); its logits can differ "
                      f"from its reference in the last bits{hint}", stacklevel=3)
    return diff


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m vqpipe.blas", description=__doc__.split("\n")[0])
    p.add_argument("--exports", action="store_true",
                   help="print `export VAR=value` lines that give a shell the policy's BLAS")
    p.add_argument("--env", action="store_true", help="print VAR=value words for env(1)")
    args = p.parse_args(argv)
    try:
        env = env_for(choice()) if sys.platform.startswith("linux") else {"VQPIPE_BLAS": choice()}
    except (ValueError, RuntimeError) as e:
        print(f"vqpipe.blas: error: {e}", file=sys.stderr)
        return 2
    pairs = [(k, env.get(k, "")) for k in ("VQPIPE_BLAS", "LD_PRELOAD")]
    if "OPENBLAS_CORETYPE" in env:
        pairs.append(("OPENBLAS_CORETYPE", env["OPENBLAS_CORETYPE"]))
    if args.exports:
        print("\n".join(f"export {k}='{v}'" for k, v in pairs))
    elif args.env:
        print(" ".join(f"{k}={v}" for k, v in pairs))
    else:
        print(f"policy: VQPIPE_BLAS={os.environ.get('VQPIPE_BLAS', 'auto')} -> {choice()}; "
              f"this process preloads: {preloaded()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
