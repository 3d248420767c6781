"""What mlx-lm's DWQ (mlx_lm.quant.dwq) would cost on this machine: seconds per training step.

DWQ distils a quantized student (affine, trainable scales and biases) towards the source's
logits: every step runs the source forward, the student forward and backward. This times that
step (mlx-lm's loss: kl_div_loss at temperature 2, Adam on the float32 copies of the scales
and biases, as dwq_quantize does) on calibration-text batches of --batch x --tokens, steps
interleaved with nothing else, and extrapolates to mlx-lm's defaults (2048 samples of up to
1025 tokens, batch 4: 512 steps) by tokens per step.

    python scripts/dwq_cost.py --source results/models/smollm2/source --steps 3 --tokens 128
"""

import argparse
import json
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map


def main(argv=None):
    from mlx_lm.tuner.losses import kl_div_loss
    from mlx_lm.utils import dequantize_model, load

    from vqpipe import text
    from vqpipe.bench.harness import summarize

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one untimed)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    teacher, tok = load(args.source)
    teacher = dequantize_model(teacher)
    teacher.set_dtype(mx.float32)  # MLX's CPU bf16 matmul is ~20x slower than float32
    student, _ = load(args.source)
    student = dequantize_model(student)
    student.set_dtype(mx.float32)
    nn.quantize(student, group_size=args.group_size, bits=args.bits)
    student.freeze()

    def unfreeze(_, m):  # as dwq_quantize: the scales and biases of every quantized layer train
        if hasattr(m, "bits") and getattr(m, "mode", "affine") == "affine" and m.bits < 8:
            m.unfreeze(keys=["scales", "biases"], recurse=False)

    student.apply_to_modules(unfreeze)
    student.train()
    params = tree_map(lambda x: x.astype(mx.float32), student.trainable_parameters())
    opt = optim.Adam(learning_rate=1e-6, bias_correction=True)
    data = text.calibration_tokens(tok, args.batch * (args.steps + 1), args.tokens, seed=0)

    def loss_fn(params, x, targets):
        student.update(params)
        return kl_div_loss(student(x) / 2.0, targets / 2.0).mean()

    seconds, cpu = [], []
    for i in range(args.steps + 1):
        x = data[i * args.batch:(i + 1) * args.batch]
        t0, c0 = time.perf_counter(), time.process_time()
        targets = teacher(x)
        mx.eval(targets)
        loss, grads = mx.value_and_grad(loss_fn)(params, x, targets)
        params = opt.apply_gradients(grads, params)
        mx.eval(loss, params)
        if i:
            seconds.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        print(f"step {i}: {time.perf_counter() - t0:.1f} s wall, {time.process_time() - c0:.1f} CPU-s, loss {loss.item():.4f}",
              flush=True)
    tokens = args.batch * args.tokens
    per_token = summarize([c / tokens for c in cpu])
    default_steps, default_tokens = 2048 // 4, 4 * 1024
    out = {"bits": args.bits, "group_size": args.group_size, "batch": args.batch, "tokens": args.tokens,
           "step_seconds": summarize(seconds), "step_cpu_seconds": summarize(cpu),
           "cpu_seconds_per_token": per_token,
           "mlx_lm_default": {"steps": default_steps, "tokens_per_step": default_tokens,
                              "cpu_hours_estimate": per_token["median"] * default_tokens * default_steps / 3600}}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
