"""KIVI KV-cache quantization: reference quantizer, fused Metal/CUDA kernels, and an mlx-lm cache.

    from vqpipe.kivi import make_kivi_cache
    cache = make_kivi_cache(model, bits=4, group_size=32, residual_length=128)
    mlx_lm.generate(model, tokenizer, prompt, prompt_cache=cache)

See docs/kivi.md.
"""

from .cache import KIVICache, cache_stats, make_kivi_cache
from .kernels import (
    backend,
    compiled_kernel_count,
    fake_quant_keys,
    fake_quant_kv,
    fake_quant_kv_hat,
    fake_quant_values,
    kernels_active,
    set_enabled,
)

__all__ = [
    "KIVICache",
    "backend",
    "cache_stats",
    "compiled_kernel_count",
    "fake_quant_keys",
    "fake_quant_kv",
    "fake_quant_kv_hat",
    "fake_quant_values",
    "kernels_active",
    "make_kivi_cache",
    "set_enabled",
]
