"""Zero-copy adoption of reservoir file pages as MLX arrays (Apple silicon; untested)."""

import os

import mlx.core as mx
import numpy as np


def wanted():
    """Opt-in (``VQPIPE_ZERO_COPY=1``), Metal only: wrap page-aligned file pages as MLX arrays.

    Never exercised: we had no Apple machine. Trade-off: no copy and pages shared between processes,
    but the arrays stay backed by the file, so truncating it later faults (SIGBUS) like any mmap.
    """
    return os.environ.get("VQPIPE_ZERO_COPY", "").strip() == "1" and mx.metal.is_available()


def adopt(mm, start, nbytes):
    """An MLX array over the mapped bytes without a copy, or None when MLX will not adopt them."""
    try:
        return mx.asarray(np.frombuffer(mm, np.uint8, nbytes, start), copy=False)
    except (ValueError, TypeError, BufferError, RuntimeError):
        return None
