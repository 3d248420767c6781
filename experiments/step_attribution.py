"""Where a compiled decode step's time goes: the host (graph replay + MLX's encode) or the GPU.

For each arm (the models of ``bench.decode_shapes``) through ``decode_step``'s split or whole mode:

- ``decode_tok_s``: ``--rounds`` rounds of ``--tokens`` tokens, all arms interleaved with an A/A
  copy of the first (its floor), steps queued as ``Decoder.generate`` queues them (step i + 1
  before token i is read); median [min-max] over rounds;
- ``pipelined``: one more such round, per step the host time (``step()`` + ``mx.async_eval``:
  everything the host does before it waits, MLX's own throttling included) and the wall time per
  token. Host ≈ wall means the step is host-bound.
- ``gpu``: the GPU's own time per step, free of the host: a spin kernel (one thread reading
  ``%globaltimer`` until ``--spin-ms`` passed) is queued first, then ``--gpu-steps`` steps; while the
  GPU spins the host encodes them, so once it stops they run back to back. GPU time per step =
  (spin + steps, to ``mx.synchronize``) − (spin alone), n = ``--repeats``, valid only when the host
  had queued everything before the spin ended (``host_done_s`` < spin; recorded as ``valid``).
  MLX blocks the host once about ten command buffers are in flight (each holds
  ``MLX_MAX_OPS_PER_BUFFER`` kernels, 20 by default on CUDA), so at the default a step of 500+
  primitives cannot be queued behind the spin: then ``valid`` is false and the figure is the time
  the steps took after the spin with the host still encoding (an upper bound on the GPU's part).
- ``profile``: ``decode_shapes.step_profile`` (primitives per step by type, unpipelined build/encode).

    python -m experiments.step_attribution --preset llama3-8b --arms bf16 affine4 vqpipe-b4 --out FILE.json
"""

import argparse
import os
import sys
import time

import mlx.core as mx

from experiments import decode_shapes as ds
from vqpipe.bench import harness
from vqpipe.kernels import qmv
from vqpipe.sources import synth
from vqpipe.store.fsutil import write_json
from vqpipe.bench.env import environment

_SPIN = """
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)NS);
    out[0] = x[0];
"""
_spin = []


def spin(ms):
    """A one-thread kernel that keeps the GPU busy for ``ms`` milliseconds (queued, not evaluated)."""
    if not _spin:
        _spin.append(mx.fast.cuda_kernel(name="vq_spin", input_names=["x"], output_names=["out"], source=_SPIN))
    return _spin[0](inputs=[mx.zeros((1,), mx.float32)], template=[("NS", int(ms * 1e6))], grid=(1, 1, 1),
                    threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])[0]


def on_cuda():
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def gpu_time(step, k, spin_ms, repeats):
    """GPU seconds per step (see the module docstring), with the host's queueing time for k steps;
    ``{"skipped": why}`` off CUDA (the spin kernel is CUDA)."""
    if not on_cuda():
        return {"skipped": "no CUDA default device: the spin kernel is CUDA"}
    def once(n):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.async_eval(spin(spin_ms))
        outs = [step() for _ in range(n)]
        if outs:
            mx.async_eval(outs)
        t1 = time.perf_counter()
        mx.synchronize()
        return time.perf_counter() - t0, t1 - t0

    once(k), once(0)  # warm: the spin kernel compiled, the step traced
    per, host, alone = [], [], []
    for _ in range(repeats):
        a, _ = once(0)
        t, h = once(k)
        alone.append(a), per.append((t - a) / k), host.append(h)
    return {"per_step_s": harness.summarize(per), "spin_alone_s": harness.summarize(alone),
            "host_done_s": harness.summarize(host), "steps": k, "spin_ms": spin_ms,
            "valid": max(host) < 0.9 * spin_ms / 1e3}


def pipelined(step, n):
    """Host seconds per step and wall seconds per token with step i + 1 queued before token i is read."""
    tok = step()
    mx.eval(tok)
    host, t_start = [], time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        nxt = step()
        mx.async_eval(nxt)
        host.append(time.perf_counter() - t0)
        tok.item()
        tok = nxt
    mx.synchronize()
    wall = (time.perf_counter() - t_start) / n
    return {"host_s": harness.summarize(host), "wall_per_token_s": wall, "steps": n}


def timing(model, vocab, mode, rot, context=512, pipelined_steps=48, gpu_steps=8, spin_ms=250.0, repeats=5, **options):
    """``pipelined`` and ``gpu`` (module docstring) of one arm's compiled step at ``context``."""
    with qmv.rotating_in_kernel(rot):
        prompt = mx.random.randint(0, vocab - 16, (context,), key=mx.random.key(7))
        step = ds._compiled_step(model, prompt, pipelined_steps + (repeats + 3) * gpu_steps + 8, mode, **options)
        return {"pipelined": pipelined(step, pipelined_steps), "gpu": gpu_time(step, gpu_steps, spin_ms, repeats)}


def line(name, r):
    p, g, f = r["pipelined"], r["gpu"], r["profile"]
    gpu = (f"GPU {g['per_step_s']['median'] * 1e3:.2f} ms/step [{g['per_step_s']['min'] * 1e3:.2f}-"
           f"{g['per_step_s']['max'] * 1e3:.2f}] (valid {g['valid']}, host queued {g['steps']} in "
           f"{g['host_done_s']['max'] * 1e3:.0f} ms)") if "skipped" not in g else f"GPU time skipped ({g['skipped']})"
    return (f"{name}: wall {p['wall_per_token_s'] * 1e3:.2f} ms/token, host {p['host_s']['median'] * 1e3:.2f} ms/step "
            f"(pipelined); {gpu}; {f['ops']} primitives, {p['host_s']['median'] / max(f['ops'], 1) * 1e6:.1f} us host each")


def _build(args):
    models = {"bf16": ds.random_full(args.preset)}
    if "affine4" in args.arms:
        models["affine4"] = ds.affine(models["bf16"], args.preset)
    for arm in args.arms:
        base = arm.removesuffix(ds.ROT)
        if base.startswith("vqpipe-b") and base not in models:
            models[base] = ds.random_vqpipe(args.preset, int(base.removeprefix("vqpipe-b")))
    return models


def run(args, progress=print):
    """Per arm and mode: a step, timed pipelined in ``--rounds`` interleaved rounds of ``--tokens``
    tokens (an A/A copy of the first arm gives the floor; each arm decodes on from where its last
    round stopped, so the context grows from ``--context``), then its GPU time and step profile."""
    vocab = synth.make_config(args.preset)["vocab_size"]
    t0 = time.perf_counter()
    models = _build(args)
    progress(f"built {', '.join(models)} ({time.perf_counter() - t0:.0f} s)")  # a run cut short says how far it got
    suffix = {mode: sfx for sfx, mode in ds.MODES.items()}  # decode_shapes' arm names: +s split, +c whole
    names = [(arm + suffix[mode], arm, mode) for arm in args.arms for mode in args.modes]
    steps, prompt = {}, mx.random.randint(0, vocab - 16, (args.context,), key=mx.random.key(7))
    capacity = (args.rounds + 1) * (args.tokens + 2) + (args.repeats + 3) * args.gpu_steps + 16
    for name, arm, mode in names + [(names[0][0] + harness.AA_SUFFIX, names[0][1], names[0][2])]:
        with qmv.rotating_in_kernel(arm.endswith(ds.ROT)):
            steps[name] = (ds._compiled_step(models[arm.removesuffix(ds.ROT)], prompt, capacity, mode), arm.endswith(ds.ROT))
    progress(f"steps traced, kernels compiled ({time.perf_counter() - t0:.0f} s)")
    walls = {n: [] for n in steps}
    for r in range(args.rounds + 1):  # round 0: warm-up
        last = {}
        for n, (step, rot) in steps.items():
            with qmv.rotating_in_kernel(rot):
                last[n] = pipelined(step, args.tokens)["wall_per_token_s"]
            if r:
                walls[n].append(last[n])
        progress(f"round {r}: " + ", ".join(f"{n} {1 / w:.1f}" for n, w in last.items()) + f" tok/s ({time.perf_counter() - t0:.0f} s)")
    aa = names[0][0] + harness.AA_SUFFIX
    floor = harness.noise_floor(walls[names[0][0]], walls[aa])
    out = {"kind": "step-attribution", "preset": args.preset, "environment": environment(),
           "settings": {k: v for k, v in vars(args).items() if k != "out"},
           "mlx_env": {k: v for k, v in os.environ.items() if k.startswith(("MLX_", "VQPIPE_"))},
           "noise_floor": floor, "arms": {}}
    for name, arm, mode in names:
        step, rot = steps[name]
        with qmv.rotating_in_kernel(rot):
            pipe = pipelined(step, args.tokens)
            gpu = gpu_time(step, args.gpu_steps, args.spin_ms, args.repeats)
        prof = ds.step_profile(models[arm.removesuffix(ds.ROT)], vocab, rot, context=args.context, mode=mode)
        tok_s = harness.summarize([1 / w for w in walls[name]])
        out["arms"][name] = r = {"decode_tok_s": tok_s, "pipelined": pipe, "gpu": gpu, "profile": prof}
        progress(f"{name}: decode {tok_s['median']:.1f} tok/s [{tok_s['min']:.1f}-{tok_s['max']:.1f}] n={tok_s['n']} "
                 f"(floor ±{floor:.1%}); " + line(name, r))
        if name != names[0][0]:
            cmp = harness.compare(walls[names[0][0]], walls[name], floor)
            r["vs_" + names[0][0]] = cmp
            progress(f"  {name} vs {names[0][0]}: {cmp['text']}")
        if args.out:
            write_json(args.out, out)
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.step_attribution", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b", choices=list(synth.PRESETS))
    p.add_argument("--out", required=True)
    p.add_argument("--arms", nargs="+", default=["bf16", "affine4", "vqpipe-b4"])
    p.add_argument("--modes", nargs="+", default=["split"], choices=("split", "whole"))
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--gpu-steps", type=int, default=8)
    p.add_argument("--spin-ms", type=float, default=250.0)
    p.add_argument("--repeats", type=int, default=5, help="GPU-time samples per arm")
    p.add_argument("--rounds", type=int, default=5, help="interleaved pipelined decode rounds per arm")
    p.add_argument("--tokens", type=int, default=32, help="tokens per round")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    write_json(args.out, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
