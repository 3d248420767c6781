"""Roofline: measured memory bandwidth and matmul throughput, bytes and FLOPs per decode token.

Decoding one token reads every weight once plus the KV cache, with ~2 FLOPs per weight: a low
arithmetic intensity, so it is memory-bound. Prefill of S tokens reuses each weight S times and is
compute-bound. The report places both on one plot against the two measured roofs (vqpipe/report/plots.py).
"""

import os
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .harness import run_interleaved, summarize


def _cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def measure_copy_bandwidth(nbytes=256 << 20, repeats=10, warmup=2, method="auto", threads=None):
    """Memory bandwidth from copying ``nbytes`` (>> last-level cache), in bytes/s counting read + write.

    ``method="auto"``: on a GPU, an MLX copy on the device; on the CPU, ``numpy.copyto`` split over
    all cores. MLX's CPU elementwise kernels run well below memory bandwidth on x86 (see
    docs/benchmarking.md), so an MLX copy there measures the kernel, not the machine; ``method="mlx"``
    gives that figure anyway.
    """
    if method == "auto":
        method = "mlx" if mx.default_device().type == mx.gpu else "numpy"
    n = nbytes // 4
    if method == "mlx":
        src = mx.ones((n,), dtype=mx.float32)
        mx.eval(src)
        arms = {"copy": lambda i: src + 0}
        threads = None
    elif method == "numpy":
        threads = threads or _cpu_count()
        src, dst = np.ones(n, np.float32), np.ones(n, np.float32)  # ones: pages touched up front
        pairs = list(zip(np.array_split(src, threads), np.array_split(dst, threads)))
        pool = ThreadPoolExecutor(threads)

        def copy(i):
            for f in [pool.submit(np.copyto, d, s) for s, d in pairs]:
                f.result()

        arms = {"copy": copy}
    else:
        raise ValueError(f"unknown method {method!r}")
    try:
        times = run_interleaved(arms, 1, repeats, warmup)["copy"]
    finally:
        if method == "numpy":
            pool.shutdown()
    out = summarize([2 * 4 * n / t for t in times])
    out.update(unit="B/s", method=method, bytes=4 * n, threads=threads)
    return out


def matmul_flops(m, k, n, dtype="float32", repeats=5, warmup=1, n_inputs=2):
    """FLOP/s of an ``[m, k] @ [k, n]`` matmul (2mkn FLOPs), on rotating distinct inputs."""
    dt = getattr(mx, dtype)
    keys = mx.random.split(mx.random.key(1), 2 * n_inputs)
    a = [mx.random.normal((m, k), key=keys[2 * j]).astype(dt) for j in range(n_inputs)]
    b = [mx.random.normal((k, n), key=keys[2 * j + 1]).astype(dt) for j in range(n_inputs)]
    mx.eval(a, b)
    times = run_interleaved({"mm": lambda i: a[i] @ b[i]}, n_inputs, repeats, warmup)["mm"]
    out = summarize([2 * m * k * n / t for t in times])
    out.update(unit="FLOP/s", shape=[m, k, n], dtype=dtype)
    return out


def _model_params(model):
    return tree_flatten(model.parameters())


def _untied_embedding(params):
    # mlx-lm models name the input embedding ``*embed_tokens*`` and an untied output ``lm_head``.
    names = [k for k, _ in params]
    if not any(k.startswith("lm_head.") or ".lm_head." in k for k in names):
        return []
    return [(k, v) for k, v in params if "embed_tokens." in k]


def weight_bytes_read(model):
    """Bytes of weights one decode token reads: every parameter, except that an untied input
    embedding contributes one row (a lookup), not the whole table."""
    params = _model_params(model)
    total = sum(v.nbytes for _, v in params)
    emb = _untied_embedding(params)
    if emb:
        vocab = max(v.shape[0] for _, v in emb)
        total -= sum(v.nbytes for _, v in emb) * (vocab - 1) / vocab
    return int(round(total))


def matmul_params(model):
    """Weights that take part in a multiply-add per token (so decode FLOPs ~= 2x this), counted on a
    full-precision model: all >= 2-D parameters, minus an untied input embedding."""
    params = _model_params(model)
    if any(v.dtype in (mx.uint32, mx.uint8) for _, v in params):
        raise ValueError("count matmul parameters on the full-precision model (packed weights found)")
    emb = {k for k, _ in _untied_embedding(params)}
    return int(sum(v.size for k, v in params if v.ndim >= 2 and k not in emb))


def _config_dims(config):
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return config["num_hidden_layers"], heads, kv_heads, head_dim


def kv_bytes_per_position(config, bytes_per_element=4):
    """KV-cache bytes one context position holds (K and V, every layer), from a HF ``config.json``."""
    layers, _, kv_heads, head_dim = _config_dims(config)
    return int(2 * layers * kv_heads * head_dim * bytes_per_element)


def decode_bytes_per_token(weight_bytes, kv_bytes_per_pos, context):
    """Bytes read to decode one token at ``context`` cached positions: weights + the whole KV cache."""
    return int(weight_bytes + kv_bytes_per_pos * context)


def flops_per_token(n_matmul_params, config=None, context=0):
    """~FLOPs to decode one token: 2 per weight, plus attention (QK^T and AV) over ``context``."""
    flops = 2 * n_matmul_params
    if config is not None and context:
        layers, heads, _, head_dim = _config_dims(config)
        flops += 4 * layers * heads * head_dim * context
    return int(flops)


def achieved(bytes_per_token, tok_s, peak):
    """Achieved bandwidth (bytes/token x tok/s) in bytes/s and as a percentage of ``peak`` bytes/s."""
    bps = bytes_per_token * tok_s
    return {"bytes_per_s": bps, "percent_of_peak": 100.0 * bps / peak}
