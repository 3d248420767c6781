"""The BLAS benchmark: matmul FLOP/s and a small model's prefill/decode under each CPU BLAS setup.

``python -m experiments.blas_setups --runs 3 --repeats 5`` measures every setup (vqpipe/blas.py) in fresh
processes, interleaved (reference, OpenBLAS, reference, ...), and checks each is deterministic.
Figures: docs/blas.md.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys

from experiments import child_env
from vqpipe.blas import choice, env_for, in_use, openblas_available
from vqpipe.store.fsutil import write_json

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

    from vqpipe.bench.roofline import matmul_flops

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

    from vqpipe.bench.harness import run_interleaved, summarize

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
            cmd = [sys.executable, "-m", "experiments.blas_setups", "--child", "--repeats", str(repeats), "--warmup", str(warmup)]
            proc = subprocess.run(cmd, env=env_for(s, child_env()), capture_output=True, text=True, check=True)
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
    p = argparse.ArgumentParser(prog="python -m experiments.blas_setups", description=__doc__.split("\n")[0])
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
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
