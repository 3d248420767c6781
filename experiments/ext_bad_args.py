"""The compiled extension's bad-argument cases on the default device, to find one that crashes.

    python experiments/ext_bad_args.py          # every case in this process (run it under gdb)
    python experiments/ext_bad_args.py --each   # each case in a process of its own: its exit status

A case passes when the op raises ValueError naming the problem; a crash shows as a signal.
"""

import subprocess
import sys

import mlx.core as mx
import numpy as np

from vqpipe.kernels import ext
from vqpipe.codec.bitpack import pack


def cases():
    rng = np.random.default_rng(1)
    bits, out, n = 4, 8, 64
    idx = rng.integers(0, 1 << bits, (out, n)).astype(np.uint8)
    p = mx.array(pack(idx, bits))
    c = mx.array(np.sort(rng.standard_normal(1 << bits)).astype(np.float32))
    s = mx.array((rng.random(out) + 0.5).astype(np.float32))
    x = mx.array(rng.standard_normal((1, n)).astype(np.float32))
    return [
        ("bits", lambda: ext.matvec(x, p, s, c, 7)),
        ("words per row", lambda: ext.matvec(x[:, :32], p, s, c, 4)),
        ("words per row, contiguous x", lambda: ext.matvec(mx.contiguous(x[:, :32]), p, s, c, 4)),
        ("per-row scales", lambda: ext.matvec(x, p, s[:4], c, 4)),
        ("group scales", lambda: ext.matvec(x, p, s, c, 4, None, 32)),
        ("does not divide", lambda: ext.matvec(x, p, mx.zeros((8, 2), mx.float16), c, 4, None, 48)),
        ("codebook", lambda: ext.matvec(x, p, s, c[:8], 4)),
        ("bias", lambda: ext.matvec(x, p, s, c, 4, mx.zeros((3,)))),
        ("dtype", lambda: ext.matvec(x.astype(mx.int32), p, s, c, 4)),
        ("good call", lambda: mx.eval(ext.matvec(x, p, s, c, 4))),
    ]


def run(k=None):
    for i, (name, call) in enumerate(cases()):
        if k is not None and i != k:
            continue
        try:
            call()
            print(f"{i} {name}: no error", flush=True)
        except ValueError as e:
            print(f"{i} {name}: ValueError: {e}", flush=True)


def main():
    print("device", mx.default_device(), "ext", ext.available(), flush=True)
    if "--each" not in sys.argv:
        return run(int(sys.argv[1]) if len(sys.argv) > 1 else None)
    for i in range(len(cases())):
        r = subprocess.run([sys.executable, __file__, str(i)], capture_output=True, text=True)
        print(f"case {i}: exit {r.returncode}; {(r.stdout.splitlines() or [''])[-1]} {r.stderr.strip()[-200:]}", flush=True)


if __name__ == "__main__":
    main()
