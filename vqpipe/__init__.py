"""vqpipe: rotation + Lloyd-Max quantized LLMs on MLX, built as staged, cached artifacts."""

__version__ = "0.1.0"


def load(path):
    """Load ``(model, tokenizer)`` from a reservoir directory, like ``mlx_lm.load``."""
    from .reservoir import load as _load

    return _load(path)
