"""The CPU row limit (ext.MAX_M) for trellis layers with the extension's decode on the dense path: one
call of a SmolLM2 4-bit reservoir's gate|up and down, the trellis mat-vec against decode + matmul, per M.

    python cpu_threshold.py RESERVOIR
"""
import statistics, time, sys
import mlx.core as mx
import vqpipe
from vqpipe.kernels import ext, dequant
model, _ = vqpipe.load(sys.argv[1])
layer = model.model.layers[len(model.model.layers) // 2]
gate = layer.mlp.gate_proj.__dict__.get("_fused") or layer.mlp.gate_proj
down = layer.mlp.down_proj
for name, l in (("gate|up", gate), ("down", down)):
    L, scale = l.trellis
    n = l.packed.shape[1] // (8 * l.bits) * 8
    for m in (16, 32, 48, 64, 96, 128, 192, 256):
        xs = [mx.random.normal((m, n)) for _ in range(20)]
        mx.eval(xs)
        arms = {"kernel": lambda x: ext.trellis_matvec(x, l.packed, l.scales, l.bits, L, scale, None),
                "dense": lambda x: dequant.trellis_forward(x, l.packed, l.scales, l.codebook, l.bits, L, None, scale)}
        ts = {k: [] for k in arms}
        for f in arms.values(): mx.eval(f(xs[0]))
        for rep in range(3):
            for x in xs:
                for k, f in arms.items():
                    a = time.perf_counter(); mx.eval(f(x)); ts[k].append((time.perf_counter() - a) * 1e3)
        r = sorted(a / b for a, b in zip(ts["kernel"], ts["dense"]))
        print(name, l.bits, m, "kernel %.3f ms dense %.3f ms ratio %.2f [%.2f-%.2f]" % (statistics.median(ts["kernel"]), statistics.median(ts["dense"]), statistics.median(r), r[0], r[-1]), flush=True)
