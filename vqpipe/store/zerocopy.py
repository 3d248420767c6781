"""Zero-copy adoption of reservoir file pages as MLX arrays (Apple silicon; untested)."""

import mlx.core as mx
import numpy as np

_on = False


def enable(flag=True):
    """Opt in (Metal only): later loads wrap page-aligned file pages as MLX arrays. Returns the
    previous setting.

    Never exercised: we had no Apple machine. Trade-off: no copy and pages shared between processes,
    but the arrays stay backed by the file, so truncating it later faults (SIGBUS) like any mmap.
    """
    global _on
    previous, _on = _on, bool(flag)
    return previous


def wanted():
    return _on and mx.metal.is_available()


def adopt(mm, start, nbytes):
    """An MLX array over the mapped bytes without a copy, or None when MLX will not adopt them."""
    try:
        return mx.asarray(np.frombuffer(mm, np.uint8, nbytes, start), copy=False)
    except (ValueError, TypeError, BufferError, RuntimeError):
        return None
