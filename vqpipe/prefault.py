"""Prefaulting the memory a reservoir load copies into (Linux, glibc).

A fresh process must fault in every page of the memory it copies the blobs into. On our 2-core VM
a trapped 4 KiB page fault costs ~2 us, so owning 692 MiB of new memory took ~0.4 s: most of a
0.5 s load. Asking the kernel for the pages in one call (madvise MADV_POPULATE_WRITE) costs about
half as much per page, and a helper thread can do it while the main thread copies. The pages must
be the ones MLX's allocator (malloc) will hand out next: for the duration of the load, large
mallocs are kept out of mmap (M_MMAP_MAX = 0) and on the heap, which is grown by the bytes about to
be read and not trimmed (M_TRIM_THRESHOLD); MLX's buffers are then carved from those pages in
order. This only changes *where* the buffers live, never their contents; afterwards malloc gets
_GLIBC_AFTER. See docs/loading.md for measurements, the side effects,
and why transparent huge pages are not used. VQPIPE_PREFAULT=0 turns it off.
"""

import contextlib
import ctypes
import mmap
import os
import sys
import threading

import numpy as np

from . import gpu


def env_off(name):
    return os.environ.get(name, "").strip().lower() in ("0", "off", "no", "false")


PREFAULT_MIN = 64 << 20  # smaller loads are not worth a thread
_PREFAULT_STEP = 16 << 20
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; older kernels answer EINVAL and nothing is prefaulted
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -2, -3, -4
# Any mallopt() of these turns off glibc's dynamic mmap threshold for good (it starts at 128 KiB and
# rises to the size of each freed mmapped chunk, up to 32 MiB, with the trim threshold at twice that).
# Afterwards we set the state it settles in once a chunk of >= 32 MiB was freed (as the copies of a
# model load do): with the plain defaults instead, every allocation above 128 KiB would be a fresh
# mmap with fresh page faults for the rest of the process (measured: numpy churn 1.8x slower).
_GLIBC_AFTER = ((_M_MMAP_MAX, 65536), (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 64 << 20))
_prefault_lock = threading.Lock()
_libc_cache = []


def _glibc():
    if not _libc_cache:
        libc = None
        try:
            if sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
                libc = ctypes.CDLL(None, use_errno=True)
                libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
                libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                libc.madvise.restype = ctypes.c_int
                libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, ValueError, AttributeError):
            libc = None
        _libc_cache.append(libc)
    return _libc_cache[0]


# What a stage that churns through large temporaries keeps (hold_freed_heap): freed chunks up to
# 32 MiB go back to the heap, not to munmap, and up to 1 GiB of free heap top is kept, not trimmed.
# Memory given back to this VM's kernel is reported to the hypervisor and costs a trapped fault per
# page when touched again; calibrate's numpy blocks (25 MB SwiGLU outputs, attention scores) were
# freed and refaulted all the time: 8 windows, system time 2.88 -> 1.66 s (n = 2 each).
# The top pad (256 MiB more per heap growth) is what the calibrated quantize timings of
# docs/results/2026-12-05-logs/quantize.md, "Fourth pass", were measured with (GPTQ temporaries of 17-29 MB).
_HOLD_HEAP = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 256 << 20))


_held = []  # [True] once hold_freed_heap applied its settings in this process


def hold_freed_heap():
    """Keep freed malloc memory in this process (glibc; see _HOLD_HEAP). Only where the memory of
    the process is not what is measured, and not where the environment sets malloc tunables (they
    win). Returns whether it was applied."""
    libc = _glibc()
    tun = os.environ.get("GLIBC_TUNABLES", "")
    if libc is None or any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ) or "malloc." in tun:
        return False
    for param, value in _HOLD_HEAP:
        libc.mallopt(param, value)
    _held[:] = [True]
    return True


@contextlib.contextmanager
def large_blocks_on_heap():
    """While it runs, blocks above glibc's mmap threshold (32 MiB) come from the heap as well, and
    freed ones are reused from it (hold_freed_heap keeps them): above the threshold each block
    was a fresh mmap, faulted in page by page and unmapped when freed. Calibrated quantization
    makes and frees several d x d float32 matrices per block (qwen2.5-0.5b's 4864-wide down_proj
    input: 95 MB each, the one MLX copies for its Cholesky in 23k page faults every time; 0.56 M of
    the stage's 0.95 M faults; docs/results/2026-12-05-logs/quantize.md, "Sixth pass"). Only where hold_freed_heap was
    applied (a stage process, whose memory is not what it measures); otherwise nothing changes."""
    libc = _glibc() if _held else None
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_MAX, 0)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_MAX, dict(_GLIBC_AFTER)[_M_MMAP_MAX])
        # The free blocks held back go to the kernel now: what comes next (the reference logits'
        # prefaulted heap top) would otherwise be added on top of them (peak RSS 2.0 -> 2.5 GB)
        libc.malloc_trim(0)


def prefault_policy():
    """``(on, reason)``: whether loads prefault their destination memory in this process."""
    if env_off("VQPIPE_PREFAULT"):
        return False, "VQPIPE_PREFAULT=0"
    if gpu.available() is not None:
        return False, "GPU backend: MLX does not allocate with malloc"
    if _glibc() is None:
        return False, "not Linux with glibc"
    tun = os.environ.get("GLIBC_TUNABLES", "")
    if any(k in os.environ for k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_")) or \
            "malloc.trim_threshold" in tun or "malloc.mmap_max" in tun:
        return False, "malloc trim/mmap settings are set in the environment (they could not be restored)"
    return True, "glibc heap prefaulted with MADV_POPULATE_WRITE by a helper thread"


class Prefault:
    """Context: grow the malloc heap by ``nbytes`` and populate it page by page from a helper thread."""

    def __init__(self, nbytes):
        self.nbytes, self.range, self.thread, self.libc, self.checked = nbytes, None, None, None, False
        self.stop = threading.Event()

    def __enter__(self):
        if self.nbytes < PREFAULT_MIN or not prefault_policy()[0] or not _prefault_lock.acquire(blocking=False):
            return self
        self.libc = libc = _glibc()
        try:
            libc.mallopt(_M_MMAP_MAX, 0)
            libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
            p = libc.malloc(self.nbytes)
            if p:
                page = mmap.PAGESIZE
                self.range = (p // page * page, -(-(p + self.nbytes) // page) * page)
                libc.free(p)  # back to the heap's top chunk, untrimmed: MLX's next buffers come from it
                self.thread = threading.Thread(target=self._populate, name="vqpipe-prefault", daemon=True)
                self.thread.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _populate(self):
        # From the top down: the main thread consumes the range from the bottom up, so the two meet
        # once instead of faulting the same pages at the same time (measured: 0.27-0.29 s vs
        # 0.31-0.39 s populating bottom-up, qwen2.5-0.5b shapes).
        start, end = self.range
        while start < end and not self.stop.is_set():
            n = min(_PREFAULT_STEP, end - start)
            if self.libc.madvise(end - n, n, _MADV_POPULATE_WRITE) != 0:
                return  # old kernel (EINVAL), or the range is gone: plain page faults instead
            end -= n

    def check(self, mv):
        """Stop populating unless the first large buffer MLX allocates overlaps the prefaulted range
        (MLX then does not allocate from this heap). It may start a little before the range: free()
        merged the block with free memory below it."""
        if self.checked or mv.nbytes < (1 << 20) or not self.range:
            return
        self.checked = True
        addr = np.frombuffer(mv, np.uint8).ctypes.data
        if not (addr < self.range[1] and addr + mv.nbytes > self.range[0]):
            self.stop.set()

    def __exit__(self, *exc):
        if self.libc is None:
            return
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        for param, value in _GLIBC_AFTER:
            self.libc.mallopt(param, value)
        self.libc = None
        _prefault_lock.release()
