"""glibc malloc settings for a process that allocates and frees large numpy temporaries.

By default glibc serves an allocation of more than a few MB with its own mmap and returns it on
free, so every new temporary of GPTQ and the refit (17 MB for a 896 x 4864 layer, 29 MB for an
8192-row chunk of a 151,936-row head) is page-faulted in again: about a fifth of calibrated
quantization's CPU time was the kernel's (docs/quantize.md, "Fourth pass"). Serving everything up
to 32 MB (glibc's largest mmap threshold) from the heap and not trimming it keeps those pages:
on four qwen2.5-0.5b blocks and the head, 946k -> 417k minor faults, system time 6.6 -> 3.7 s,
peak RSS 2.04 -> 2.28 GB. Results do not change (only where memory comes from).
"""

import ctypes
import sys

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's maximum on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TOP_PAD = 256 * 2**20


def keep_freed_memory():
    """Apply the settings above to this process (glibc only; elsewhere nothing). True if applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # 2**31 - 1: never trim the heap's top (mallopt takes an int)
    done = [mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD), mallopt(_M_TRIM_THRESHOLD, 2**31 - 1),
            mallopt(_M_TOP_PAD, TOP_PAD)]
    return all(done)
