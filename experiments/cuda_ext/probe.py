"""Host time per launch: a primitive built ahead of time with MLX's C++ extension API (``_probe.add_one``)
beside the same kernel from ``mx.fast.cuda_kernel`` (compiled at run time by NVRTC) and a built-in
(``x + 1``). A chain of N launches on 4096 floats (GPU time negligible); host = the chain's call +
``mx.async_eval``, then a full ``mx.eval`` outside the timer; arms interleaved per round; compiled
(``mx.compile``, the decode step's case) and eager. Also the first call's wall time (kernel build).

    PYTHONPATH=BUILD_DIR:$PWD python experiments/cuda_ext/probe.py --out probe.json
"""

import argparse
import json
import time

import mlx.core as mx

import _probe
from experiments.host_cost import time_chains

SOURCE = """
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < SIZE) { y[i] = x[i] + 1.0f; }
"""
SIZE = 4096


def launcher(kind):
    if kind == "builtin":
        return lambda x: x + 1  # compile fuses a chain of these into one kernel
    if kind == "rms_norm":
        w = mx.ones((SIZE,))
        return lambda x: mx.fast.rms_norm(x, w, 1e-5) + 0  # a built-in compile does not fuse (+0 fuses)
    if kind in ("ext", "ext-aa"):
        return _probe.add_one
    k = mx.fast.cuda_kernel("vq_probe_add_one", ["x"], ["y"], SOURCE)
    return lambda x: k(inputs=[x], output_shapes=[x.shape], output_dtypes=[x.dtype], grid=(SIZE, 1, 1),
                       threadgroup=(256, 1, 1), template=[("SIZE", SIZE)])[0]


def chain(kind, n):
    call = launcher(kind)

    def f(x):
        for _ in range(n):
            x = call(x)
        return x

    return f


def first_call(kinds, x):
    out = {}
    for k in kinds:
        t0 = time.perf_counter()
        y = launcher(k)(x)
        mx.eval(y)
        out[k] = time.perf_counter() - t0
        assert k == "rms_norm" or mx.array_equal(y, x + 1).item(), k
    return out


def measure(kinds, n, rounds, compiled, x):
    fns = {k: (mx.compile(chain(k, n)) if compiled else chain(k, n)) for k in kinds}
    for k, f in fns.items():
        for _ in range(3):
            y = f(x)
            mx.eval(y)
        assert k == "rms_norm" or mx.allclose(y, x + n).item(), k
    return time_chains(fns, x, n, rounds)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100, help="launches per chain")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out")
    a = p.parse_args(argv)
    kinds = ["builtin", "rms_norm", "ext"] + (["cuda_kernel"] if mx.cuda.is_available() else [])
    x = mx.random.normal((SIZE,))
    mx.eval(x)
    out = {"device": str(mx.default_device()), "n": a.n, "rounds": a.rounds, "first_call_s": first_call(kinds, x)}
    print("first call (s):", {k: round(v, 4) for k, v in out["first_call_s"].items()}, flush=True)
    for compiled in (True, False):
        mode = "compiled" if compiled else "eager"
        # "ext-aa": the extension's arm twice, for the A/A noise floor
        r = measure(kinds + ["ext-aa"], a.n, a.rounds, compiled, x)
        out[mode] = r
        for k, s in r.items():
            print(f"{mode:8s} {k:12s} {s['median']:7.2f} us/launch [{s['min']:.2f}-{s['max']:.2f}] n={s['n']}",
                  flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
