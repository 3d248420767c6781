"""Resident bytes of the packed KIVI cache at 4096 tokens beside an fp16 KVCache, SmolLM2-135M's cache
geometry (30 layers, 3 KV heads, head_dim 64), K/V written in 512-token chunks (values random: the
size does not depend on them). ``PYTHONPATH=$PWD python experiments/kivi_cpu_memory.py``"""
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from vqpipe.kivi.store import PackedKIVICache
# SmolLM2-135M geometry: 30 layers, 3 KV heads, head_dim 64
L, H, D, T = 30, 3, 64, 4096
for dt in (mx.float16, mx.float32):
    for bits in (4, 2):
        tot_kivi = tot_fp16 = 0
        for _ in range(L):
            c = PackedKIVICache(bits, 32, 128)
            f = KVCache()
            for s in range(0, T, 512):
                k = mx.random.normal((1, H, 512, D)).astype(dt); v = mx.random.normal((1, H, 512, D)).astype(dt)
                c.update_and_fetch(k, v); f.update_and_fetch(k.astype(mx.float16), v.astype(mx.float16))
            mx.eval(c.state if hasattr(c, 'state') else [])
            st = c.stats()
            tot_kivi += st["resident_nbytes"]
            tot_fp16 += f.nbytes
        print(f"activations {dt}, KIVI-{bits}: resident {tot_kivi/2**20:.2f} MiB vs fp16 KVCache {tot_fp16/2**20:.2f} MiB = {tot_kivi/tot_fp16:.3f}x")
