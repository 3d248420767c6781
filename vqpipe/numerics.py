"""Which parts of an environment record change float results, and comparing two records.

Logits computed on another backend, device, BLAS or MLX version differ in the last bits for reasons
that have nothing to do with an artifact. OpenBLAS's thread count is part of it too: some GEMM
shapes round differently with 1 and 2 threads (docs/blas.md). This is the one definition
of "the same setup" that validate, the report and ``vqpipe.load`` use.
"""

# Paths into an environment dict (vqpipe.bench.env.environment()).
SETUP_KEYS = (("backend",), ("device",), ("blas", "name"), ("blas", "threads"), ("versions", "mlx"))


def _get(env, path):
    for key in path:
        env = env.get(key) if isinstance(env, dict) else None
    return env


def setup(env, keys=SETUP_KEYS):
    """The values of ``env`` that change float results, as a dict ``{"blas.name": ..., ...}``."""
    return {".".join(path): _get(env, path) for path in keys}


def differences(reference_env, current_env, names=("reference", "here"), keys=SETUP_KEYS):
    """``["blas.name: 'openblas' (reference) != 'reference' (here)", ...]``; empty when comparable."""
    a, b = setup(reference_env, keys), setup(current_env, keys)
    return [f"{k}: {a[k]!r} ({names[0]}) != {b[k]!r} ({names[1]})" for k in a if a[k] != b[k]]


def key(env):
    """A short label of the setup, e.g. ``cpu/openblas(2 threads), mlx 0.32.4``."""
    s = setup(env)
    threads = f"({s['blas.threads']} threads)" if s["blas.threads"] else ""
    mlx = f", mlx {s['versions.mlx']}" if s["versions.mlx"] else ""
    return f"{s['backend']}/{s['blas.name']}{threads}{mlx}"


def require_same(env_a, env_b, what="results"):
    """Refuse to compare ``what`` computed under different setups."""
    diff = differences(env_a, env_b, ("first", "second"))
    if diff:
        raise ValueError(
            f"refusing to compare {what} across setups ({'; '.join(diff)}); "
            "rerun both under one VQPIPE_BLAS (and OPENBLAS_NUM_THREADS) setting"
        )
