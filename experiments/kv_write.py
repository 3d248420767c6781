"""What writing one token into a static KV cache costs, by how it is written and the cache's capacity.

decode_step's compiled step writes each layer's new key and value into buffers [1, kv_heads,
capacity, D] at a position held in a device array. ``mx.slice_update`` with an array start is a
DynamicSliceUpdate; on MLX 0.32.4's CUDA backend its copy kernel is launched over the whole
output (a grid of capacity x kv_heads x D threads) after a separate kernel computes the offset
(seen kernel by kernel in experiments/step_kernels.py), so its cost grows with the capacity, not with
the one token written. ``mx.put_along_axis`` (a ScatterAxis) launches over the update only.

Arms, interleaved per capacity, each step = ``--layers`` layers' key and value writes through one
compiled function per layer (as the split step does), then ``mx.synchronize``; ``--inputs``
distinct tokens rotated, positions advancing; median [min-max] µs per step; at the end every arm's
buffers must be equal bit for bit (the same writes), else the run fails.

    python -m experiments.kv_write --out kv.json --capacities 512,4096,32768
"""

import argparse
import sys
import time

import mlx.core as mx

from vqpipe.bench import harness
from vqpipe.store.fsutil import write_json


def write_slice(kb, vb, k, v, pos):
    start = pos.reshape(1)
    return mx.slice_update(kb, k, start, axes=(2,)), mx.slice_update(vb, v, start, axes=(2,))


def write_scatter(kb, vb, k, v, pos):
    idx = mx.broadcast_to(pos.reshape(1, 1, 1, 1), k.shape)
    return mx.put_along_axis(kb, idx, k, axis=2), mx.put_along_axis(vb, idx, v, axis=2)


ARMS = {"slice": write_slice, "scatter": write_scatter, "slice (A/A)": write_slice}


def run(capacities, layers, heads, head_dim, inputs, repeats, warmup, dtype=mx.bfloat16):
    out = []
    for cap in capacities:
        keys = mx.random.split(mx.random.key(cap), inputs)
        new = [(mx.random.normal((layers, 1, heads, 1, head_dim), key=kk).astype(dtype),) for kk in keys]
        new = [(n[0], (n[0] * 0.5).astype(dtype)) for n in new]
        mx.eval(new)
        fns = {a: mx.compile(f) for a, f in ARMS.items()}
        state = {a: [(mx.zeros((1, heads, cap, head_dim), dtype), mx.zeros((1, heads, cap, head_dim), dtype))
                     for _ in range(layers)] for a in ARMS}
        mx.eval(state)
        times = {a: [] for a in ARMS}
        for r in range(warmup + repeats):
            for a in ARMS:
                kn, vn = new[r % inputs]
                pos = mx.array(r % cap, mx.int32)
                mx.eval(pos)
                mx.synchronize()
                t0 = time.perf_counter()
                state[a] = [fns[a](kb, vb, kn[j], vn[j], pos) for j, (kb, vb) in enumerate(state[a])]
                mx.eval(state[a])
                mx.synchronize()
                if r >= warmup:
                    times[a].append(time.perf_counter() - t0)
        ref = state["slice"]
        same = all(mx.array_equal(x, y).item() for a in ARMS for p, q in zip(ref, state[a]) for x, y in zip(p, q))
        if not same:
            raise RuntimeError(f"kv_write: the arms' caches differ at capacity {cap}")
        row = {"capacity": cap, "arms": {a: harness.summarize(t) for a, t in times.items()}, "same_caches": same}
        out.append(row)
        s = row["arms"]
        print(f"capacity {cap}: " + ", ".join(
            f"{a} {s[a]['median'] * 1e6:.1f} [{s[a]['min'] * 1e6:.1f}-{s[a]['max'] * 1e6:.1f}] µs/step" for a in ARMS)
            + f" (n={repeats}, {layers} layers, caches equal)")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--capacities", type=lambda t: [int(x) for x in t.split(",") if x], default=[512, 4096, 32768])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--inputs", type=int, default=20)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    rows = run(args.capacities, args.layers, args.heads, args.head_dim, args.inputs, args.repeats, args.warmup)
    write_json(args.out, {"kind": "bench-kv-write", "settings": vars(args), "device": str(mx.default_device()), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
