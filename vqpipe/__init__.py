"""vqpipe: rotation + Lloyd-Max quantized LLMs on MLX, built as staged, cached artifacts."""

__version__ = "0.1.0"


def load(path):
    """Load ``(model, tokenizer)`` from a reservoir directory, like ``mlx_lm.load``.

    Warns (``UserWarning``) when this process's BLAS differs from the one the reservoir's reference
    logits were made under: its logits then differ in the last bits (vqpipe/blas.py, warn_if_other).
    """
    import json
    from pathlib import Path

    from .blas import warn_if_other
    from .store.reservoir import load as _load

    model, tokenizer = _load(path)
    info = Path(path) / "pack.json"
    if info.is_file():
        setup = json.loads(info.read_text()).get("reference_setup")
        if setup:
            warn_if_other(setup, f"reservoir {path}")
    return model, tokenizer
