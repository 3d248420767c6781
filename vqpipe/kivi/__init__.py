"""KIVI KV-cache quantization: reference quantizer, fused Metal/CUDA kernels, and an mlx-lm cache.

    from vqpipe.kivi import make_kivi_cache
    cache = make_kivi_cache(model, bits=4, group_size=32, residual_length=128, packed=True)
    mlx_lm.generate(model, tokenizer, prompt, prompt_cache=cache)

``packed=True``: codes resident, attention reads them (store.py, attention.py, decode_kernel.py);
``packed=False`` (the default): the quantize-dequantize reference cache.

See docs/kivi.md.
"""

from .attention import attend, install
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
from .store import PackedKIVICache

__all__ = [
    "KIVICache",
    "PackedKIVICache",
    "attend",
    "install",
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
