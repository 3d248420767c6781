"""Where the time before the first token goes, phase by phase, in one fresh process.

    python -m experiments.ttft --model RESERVOIR [--prompt-tokens 29] [--mode split] [--rounds 3]
        [--gpu-max-m M]

Phases (each closed by mx.synchronize): import, load, Decoder construction, the eager prefill,
the first compiled step (its tracing and kernel builds), the second step; then `rounds` more
prompts of the same length in the same process (what a server pays per request), then 16 greedy
tokens of the first prompt. Memory: active after load, the peak of the load, the peak from the
prefill to the end. ``--gpu-max-m`` sets the row count up to which a trellis layer on the GPU takes
the compiled mat-vec (vqpipe/kernels/ext.py GPU_MAX_M; an A/B arm of this experiment only).
Prints one JSON line.

"""

import argparse
import json
import time

T0 = time.perf_counter()
import mlx.core as mx  # noqa: E402

import vqpipe  # noqa: E402
from vqpipe.decode.step import POSITION_DTYPE, Decoder  # noqa: E402
from vqpipe.kernels import ext  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-tokens", type=int, default=29)
    p.add_argument("--mode", default="split")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gpu-max-m", type=int)
    a = p.parse_args()
    if a.gpu_max_m is not None:
        ext.GPU_MAX_M = a.gpu_max_m
    out = {"import_s": time.perf_counter() - T0, "device": str(mx.default_device()), "gpu_max_m": ext.GPU_MAX_M}

    def phase(name, fn):
        mx.synchronize()
        t = time.perf_counter()
        r = fn()
        mx.synchronize()
        out[name] = round(time.perf_counter() - t, 4)
        return r

    model, _ = phase("load_s", lambda: vqpipe.load(a.model))
    out["active_after_load_mb"] = round(mx.get_active_memory() / 1e6, 1)
    out["peak_load_mb"] = round(mx.get_peak_memory() / 1e6, 1)
    mx.reset_peak_memory()
    dec = phase("decoder_s", lambda: Decoder(model, a.prompt_tokens + 64, a.mode))
    prompt = mx.arange(100, 100 + a.prompt_tokens)
    caches = phase("new_cache_s", dec.new_cache)
    token, done = phase("prefill_s", lambda: dec.prefill(prompt, caches))
    mx.eval(token)
    dec.position = done
    pos = mx.array([done], POSITION_DTYPE)
    state = [(c.keys, c.values) for c in caches]

    def first():
        r = dec.step(token, pos, state)
        mx.eval(r[0])
        return r

    token, pos, state, _ = phase("step1_s", first)
    out["traces_after_step1"] = dec.traces
    phase("step2_s", lambda: mx.eval(dec.step(token, pos, state)[0]))
    again = []
    for r in range(a.rounds):
        prompt = mx.arange(200 + r, 200 + r + a.prompt_tokens)
        mx.synchronize()
        t = time.perf_counter()
        ids = dec.tokens(prompt, 1)
        next(ids)
        again.append(round(time.perf_counter() - t, 4))
    out["first_token_again_s"] = again
    out["tokens"] = list(Decoder(model, a.prompt_tokens + 16, a.mode).tokens(mx.arange(100, 100 + a.prompt_tokens), 16))
    out["peak_after_load_mb"] = round(mx.get_peak_memory() / 1e6, 1)
    out["traces_end"] = dec.traces
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
