"""Which GPU dialect custom kernels run in: 'metal', 'cuda' or None (shared by the qmv and KIVI kernels)."""

import functools

import mlx.core as mx


@functools.lru_cache(maxsize=1)
def available():
    """The GPU dialect MLX offers in this process, whatever the default device."""
    # Availability does not change within a process; cached because dispatch runs per layer per token.
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return None


def backend():
    """'metal', 'cuda' or None (no GPU backend, or the default device is the CPU)."""
    if mx.default_device() != mx.gpu:
        return None
    return available()


def active(use_kernels, enabled, dialect, what):
    """The kernel modules' dispatch rule: ``use_kernels`` None follows the module's switch
    ``enabled`` and the backend ``dialect``; True insists (raises without a GPU backend); False never."""
    if use_kernels is False or (use_kernels is None and not enabled):
        return False
    if dialect is None:
        if use_kernels:
            raise RuntimeError(f"{what}: needs MLX's Metal or CUDA backend on the default device")
        return False
    return True
