"""Host time per primitive, by kind: what an MLX step pays before the GPU runs anything.

The split decode step is host-bound on the H200 (docs/decode.md), and fusing built-ins into custom
kernels did not cut the host time. This measures, on tiny arrays (GPU time negligible), the host
time of a chain of N primitives of one kind, compiled (the decode step's case) and eager:

- `rms_norm`: MLX's fused RMSNorm, a built-in that compile does not fuse;
- `custom1` / `custom6`: a copy kernel from `mx.fast.cuda_kernel` with 1 / 6 inputs;
- `custom-big`: `custom1` with ~24 KB of source (the qmv kernels' size): what the per-call source
  build costs where the call is traced or eager;
- `custom-init`: `custom1` with `init_value` (a fill node per call).

Arms interleaved per round; host = the chain's call + `mx.async_eval`, then a full `mx.eval` outside
the timer. Prints µs per primitive, median [min–max] over rounds. GPU only (CUDA).
"""

import argparse
import json
import statistics
import time

import mlx.core as mx

COPY = """
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < x_size) { y[i] = x[i]; }
"""


def copy_kernel(inputs, big=False):
    names = ["x"] + [f"a{i}" for i in range(inputs - 1)]
    src = COPY + ("// " + "pad " * 6000 + "\n" if big else "")
    tag = f"vqpipe_host_copy{inputs}{'b' if big else ''}"
    return mx.fast.cuda_kernel(tag, names, ["y"], src.replace("x_size", "SIZE"))


def chain(kind, n):
    size = 4096
    extra = 5 if kind == "custom6" else 0
    k = copy_kernel(1 + extra, big=kind == "custom-big")
    w = mx.ones((size,), mx.float32)

    def call(x):
        if kind == "rms_norm":
            return mx.fast.rms_norm(x, w, 1e-5)
        init = 0.0 if kind == "custom-init" else None
        return k(inputs=[x] + [w] * extra, output_shapes=[x.shape], output_dtypes=[x.dtype],
                 grid=(size, 1, 1), threadgroup=(256, 1, 1), template=[("SIZE", size)],
                 init_value=init)[0]

    def f(x):
        for _ in range(n):
            x = call(x)
        return x

    return f


def measure(kinds, n, rounds, compiled):
    x = mx.random.normal((4096,))
    fns = {k: (mx.compile(chain(k, n)) if compiled else chain(k, n)) for k in kinds}
    for f in fns.values():
        for _ in range(3):
            mx.eval(f(x))
    return time_chains(fns, x, n, rounds)


def time_chains(fns, x, n, rounds):
    """Host µs per primitive of each chain of ``n`` in ``fns`` ({name: x -> y}, warmed up): the call
    and ``mx.async_eval`` timed, the full eval outside the timer; arms interleaved per round."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            mx.synchronize()
            t0 = time.perf_counter()
            y = f(x)
            mx.async_eval(y)
            t1 = time.perf_counter()
            mx.eval(y)
            times[k].append((t1 - t0) / n * 1e6)
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
            for k, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100, help="primitives per chain")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--kinds", nargs="+",
                   default=["rms_norm", "custom1", "custom6", "custom-big", "custom-init"])
    p.add_argument("--out")
    a = p.parse_args(argv)
    if not mx.cuda.is_available():
        raise SystemExit("host_cost: needs the CUDA backend (custom kernels are CUDA here)")
    out = {"n": a.n, "rounds": a.rounds}
    for compiled in (True, False):
        mode = "compiled" if compiled else "eager"
        r = measure(a.kinds, a.n, a.rounds, compiled)
        out[mode] = r
        for k, s in r.items():
            print(f"{mode:8s} {k:12s} {s['median']:7.2f} us/primitive "
                  f"[{s['min']:.2f}-{s['max']:.2f}] n={s['n']}", flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
