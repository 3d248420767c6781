"""Which BLAS MLX's CPU backend uses, and how vqpipe chooses it on Linux.

MLX's Linux CPU wheel bundles the Netlib reference BLAS (``mlx_cpu.libs/libblas-*.so``), whose fp32
GEMM runs at a few GFLOP/s. libmlx binds ``cblas_sgemm`` & co. through the global symbol scope first,
so preloading Debian's OpenBLAS (package ``libopenblas0-pthread``) makes every MLX matmul run on
OpenBLAS instead; see docs/benchmarking.md for the measured difference.

Policy, from the environment variable ``VQPIPE_BLAS``:

- ``auto`` (default): ``openblas`` on Linux when Debian's OpenBLAS is installed, else ``reference``.
- ``openblas``: require it (error when it is not installed).
- ``reference``: the wheel's bundled BLAS.

``ensure()`` re-executes the current program with ``LD_PRELOAD`` set (or cleared) to match; call it
before anything imports mlx. ``in_use()`` reports what this process really binds to, and every
artifact records it (``environment()["blas"]``), so results from two BLAS setups are never compared.

This module must not import mlx at import time: ``ensure()`` runs before the library is loaded.
"""

import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import sysconfig

CHOICES = ("auto", "openblas", "reference")
_REEXEC_FLAG = "_VQPIPE_BLAS_REEXEC"


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
    return out


def shell_prefix(setup=None):
    """``VAR=value`` words to put before a shell command so it runs on ``setup`` (default: the policy)."""
    setup = setup or choice()
    if setup == "openblas":
        return f"VQPIPE_BLAS=openblas LD_PRELOAD={':'.join(openblas_libs())} "
    return f"VQPIPE_BLAS={setup} "


def ensure():
    """Re-exec this program (``sys.orig_argv``) so its BLAS matches the policy; no-op when it does.

    Must run before mlx is imported: a library cannot be preloaded into a running process.
    """
    if not sys.platform.startswith("linux"):
        return
    retried = os.environ.pop(_REEXEC_FLAG, None)
    want = choice()
    if preloaded() == want:
        return
    if retried:
        print(f"vqpipe: could not switch BLAS to {want}; continuing with {preloaded()}", file=sys.stderr)
        return
    env = env_for(want)
    env[_REEXEC_FLAG] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


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


def setup_key(env):
    """``backend/blas`` (plus ``(N threads)`` for OpenBLAS) of an artifact's ``environment``. OpenBLAS's thread count is part of
    it: some GEMM shapes round differently with 1 and 2 threads (docs/benchmarking.md)."""
    b = env.get("blas") or {}
    threads = f"({b['threads']} threads)" if b.get("threads") else ""
    return f"{env.get('backend')}/{b.get('name')}{threads}"


def same_setup(env_a, env_b):
    """Whether two artifacts' ``environment`` dicts ran on the same backend and BLAS."""
    return setup_key(env_a) == setup_key(env_b)


def require_same(env_a, env_b, what="results"):
    """Refuse to compare ``what`` computed under different BLAS setups (sums differ in the last bits)."""
    if not same_setup(env_a, env_b):
        raise ValueError(
            f"refusing to compare {what} across setups {setup_key(env_a)} and {setup_key(env_b)}; "
            "rerun both under one VQPIPE_BLAS (and OPENBLAS_NUM_THREADS) setting"
        )


# --- measuring the difference ------------------------------------------------------------------

# (label, M, K, N, dtype): prefill-like GEMMs in the three dtypes and a decode-like GEMV.
CASES = (
    ("gemm", 1024, 1024, 1024, "float32"),
    ("gemm", 1024, 1024, 1024, "bfloat16"),
    ("gemm", 1024, 1024, 1024, "float16"),
    ("gemv", 1, 4096, 4096, "float32"),
)


def measure(repeats=5, warmup=1, cases=CASES):
    """Matmul FLOP/s for ``cases`` in this process, plus a checksum of each result (determinism)."""
    import mlx.core as mx
    import numpy as np

    from .bench.roofline import matmul_flops

    out = {"blas": in_use(), "loadavg_start": list(os.getloadavg()), "cases": []}
    for label, m, k, n, dtype in cases:
        rate = matmul_flops(m, k, n, dtype, repeats=repeats, warmup=warmup)
        ka, kb = mx.random.split(mx.random.key(0))
        a = mx.random.normal((m, k), key=ka).astype(getattr(mx, dtype))
        b = mx.random.normal((k, n), key=kb).astype(getattr(mx, dtype))
        c = np.asarray((a @ b).astype(mx.float32))
        digest = hashlib.sha256(c.tobytes()).hexdigest()[:16]
        out["cases"].append({"op": label, "shape": [m, k, n], "dtype": dtype, "flops": rate, "sha256": digest})
    return out


# A small llama-shaped model (random weights, ~15.5M parameters: 62 MB in fp32, beyond the L3 cache).
MODEL_ARGS = dict(
    model_type="llama", hidden_size=512, num_hidden_layers=4, intermediate_size=1408, num_attention_heads=8,
    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=8192, tie_word_embeddings=False,
)


def measure_model(dtypes=("float32", "bfloat16"), prompt=128, repeats=5, warmup=1):
    """Prefill tok/s (``prompt`` tokens) and decode tok/s (one token at context ``prompt``) per dtype."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    from .bench.harness import run_interleaved, summarize

    out = []
    for dtype in dtypes:
        mx.random.seed(0)
        model = llama.Model(llama.ModelArgs(**MODEL_ARGS))
        model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())
        prompts = [mx.random.randint(0, MODEL_ARGS["vocab_size"], (1, prompt)) for _ in range(2)]
        cache = make_prompt_cache(model)
        logits = model(prompts[0], cache=cache).astype(mx.float32)
        digest = hashlib.sha256(np.asarray(logits).tobytes()).hexdigest()[:16]

        def decode(i):
            for c in cache:  # keep the context fixed at `prompt`
                c.trim(c.offset - prompt)
            return model(prompts[i][:, :1], cache=cache)

        times = run_interleaved(
            {"prefill": lambda i: model(prompts[i]), "decode": decode}, len(prompts), repeats, warmup
        )
        out.append({
            "dtype": dtype,
            "prefill_tok_s": summarize([prompt / t for t in times["prefill"]]),
            "decode_tok_s": summarize([1 / t for t in times["decode"]]),
            "prefill_logits_sha256": digest,
        })
    return out


def compare_setups(runs=2, repeats=5, warmup=1):
    """Measure each setup in fresh subprocesses, interleaved (ref, openblas, ref, openblas, ...)."""
    setups = ["reference"] + (["openblas"] if openblas_available() else [])
    results = {s: [] for s in setups}
    for _ in range(runs):
        for s in setups:
            cmd = [sys.executable, "-m", "vqpipe.blas", "--child", "--repeats", str(repeats), "--warmup", str(warmup)]
            proc = subprocess.run(cmd, env=env_for(s), capture_output=True, text=True, check=True)
            results[s].append(json.loads(proc.stdout))
    return results


def _report(results):
    lines = []
    for setup, runs in results.items():
        lines.append(f"{setup}: {runs[0]['blas']['path']} {runs[0]['blas'].get('config', '')}".rstrip())
        loads = [r[k][0] for r in runs for k in ("loadavg_start", "loadavg_end") if k in r]
        if loads:
            lines.append(f"  1-min load average during the runs: {min(loads):.2f}-{max(loads):.2f} ({os.cpu_count()} CPUs)")
        for i, case in enumerate(runs[0]["cases"]):
            per_run = [r["cases"][i] for r in runs]
            same = len({c["sha256"] for c in per_run}) == 1 if len(per_run) > 1 else "n/a (1 run)"
            meds = ", ".join(f"{c['flops']['median'] / 1e9:.1f} [{c['flops']['min'] / 1e9:.1f}-{c['flops']['max'] / 1e9:.1f}]" for c in per_run)
            m, k, n = case["shape"]
            lines.append(
                f"  {case['op']} {m}x{k}x{n} {case['dtype']:<8} GFLOP/s median [min-max] per run "
                f"(n={case['flops']['n']}): {meds}; identical results across runs: {same}"
            )
        for i, case in enumerate(runs[0].get("model", [])):
            for key in ("prefill_tok_s", "decode_tok_s"):
                per_run = [r["model"][i][key] for r in runs]
                meds = ", ".join(f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]" for s in per_run)
                lines.append(f"  llama-15M {case['dtype']:<8} {key} median [min-max] per run (n={per_run[0]['n']}): {meds}")
            if len(runs) > 1:
                same = len({r["model"][i]["prefill_logits_sha256"] for r in runs}) == 1
                lines.append(f"  llama-15M {case['dtype']:<8} prefill logits identical across runs: {same}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m vqpipe.blas", description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--runs", type=int, default=2, help="fresh processes per setup (determinism check)")
    p.add_argument("--json", help="also write the raw figures here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = measure(args.repeats, args.warmup)
        result["model"] = measure_model(repeats=args.repeats, warmup=args.warmup)
        result["loadavg_end"] = list(os.getloadavg())
        print(json.dumps(result))
        return 0
    print(f"policy: VQPIPE_BLAS={os.environ.get('VQPIPE_BLAS', 'auto')} -> {choice()}")
    results = compare_setups(args.runs, args.repeats, args.warmup)
    print(_report(results))
    if args.json:
        from .report import write_atomic

        write_atomic(args.json, json.dumps(results, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
