"""Numpy work of calibrated quantization on several cores: a thread pool, and its thread count.

numpy (and the OpenBLAS it calls) releases the GIL in every large operation, so independent
work runs side by side in threads: the row chunks of a layer's GPTQ, refit and packing (rows are
independent; tests/test_gptq.py shows the chunks give the same bytes), and one layer's numpy work
while the main thread runs MLX for the next (the calibration forward, the Cholesky factors).
Only the main thread touches MLX. With one thread nothing is deferred: the work runs where it is
submitted, in the order it is submitted, as it did before this module.

The pool's threads run at a lower priority (nice + POOL_NICE) than the main thread and MLX's:
the main thread's chain (the next block's forward, its factors) gates the pool's next work, so
when the pool's threads and that chain share a core the chain must not be slowed to a third of
it; the pool still gets every cycle the chain leaves, and both cores when the chain waits.

Each BLAS call must then run on one thread: OpenBLAS threads on top of ours oversubscribe the
cores, and OpenBLAS's waiting threads spin (docs/results/2026-12-05-logs/quantize.md, "Second pass"). ``Pool`` sets both
OpenBLAS libraries of the process (numpy's and the one MLX binds) to one thread while it runs
more than one.
"""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from . import blas

POOL_NICE = 10  # CFS weight 110 against the main thread's 1024


def default_threads():
    """The cores this process may run on (its CPU affinity, e.g. a scheduler's allotment)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def check_threads(threads):
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    return threads


class _Done:
    """A future that is already resolved (work run inline)."""

    def __init__(self, fn, args):
        self._value = fn(*args)

    def result(self):
        return self._value


class Pool:
    """``submit(fn, *args)`` -> a future (``.result()``); inline when ``threads`` is 1."""

    def __init__(self, threads=1):
        self.threads = check_threads(threads)
        self._ex = ThreadPoolExecutor(self.threads, initializer=_lower_priority) if self.threads > 1 else None
        self._blas = blas.set_threads(1) if self._ex else []

    def submit(self, fn, *args):
        return _Done(fn, args) if self._ex is None else self._ex.submit(fn, *args)

    def map(self, fn, items):
        """[fn(item) for item in items], the items side by side, results in order."""
        return [f.result() for f in [self.submit(fn, item) for item in items]]

    def close(self):
        if self._ex is not None:
            self._ex.shutdown(wait=True)
            self._ex = None
            for setter, old in self._blas:
                setter(old)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _lower_priority():
    """Raise this thread's nice value (Linux: per thread; elsewhere, or if refused, nothing)."""
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + POOL_NICE))
        except OSError:
            pass
