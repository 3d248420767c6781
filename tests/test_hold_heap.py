"""hold_freed_heap: freed malloc memory stays in the process (not trimmed, not refaulted)."""

import subprocess
import sys

import pytest

from vqpipe import prefault

PROBE = """
import resource, sys
import numpy as np
from vqpipe.prefault import hold_freed_heap
applied = hold_freed_heap() if sys.argv[1] == "hold" else False
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
warm = np.ones(31 << 20, np.uint8)  # glibc's dynamic mmap threshold rises to 31 MiB, trim to 62
del warm
def cycle():  # 90 MiB of heap, then all of it free at the top: trimmed unless held
    xs = [np.ones(30 << 20, np.uint8) for _ in range(3)]
    del xs
cycle()
f0 = faults()
cycle()
print(applied, faults() - f0)
"""


def probe(arm, env=None):
    out = subprocess.run([sys.executable, "-c", PROBE, arm], capture_output=True, text=True, check=True,
                         env=env)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(prefault._glibc() is None, reason="glibc only")
def test_freed_memory_is_reused_without_page_faults():
    held, default = probe("hold"), probe("default")
    assert held[0] and not default[0]
    assert default[1] > 500 and held[1] < default[1] / 10, (held, default)


def test_malloc_settings_in_the_environment_win(monkeypatch):
    import os

    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "131072"}
    assert probe("hold", env)[0] is False
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")
    assert prefault.hold_freed_heap() is False


LARGE = """
import resource, sys
import mlx.core as mx
import numpy as np
from vqpipe.prefault import hold_freed_heap, large_blocks_on_heap
if sys.argv[1] != "unheld":
    hold_freed_heap()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
src = np.ones(24 << 20, np.float32)  # 96 MiB: above glibc's mmap threshold (32 MiB)
def cycle():  # what ldl_factor does per 4864-wide input: MLX copies a d x d matrix, then frees it
    a = mx.array(src)
    mx.eval(a)
    del a
with large_blocks_on_heap() if sys.argv[1] != "held" else open("/dev/null"):
    cycle()
    f0 = faults()
    for _ in range(3):
        cycle()
    print(faults() - f0)
"""


def large_probe(arm):
    out = subprocess.run([sys.executable, "-c", LARGE, arm], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(prefault._glibc() is None, reason="glibc only")
def test_large_blocks_are_reused_from_the_heap():
    # 3 x 96 MiB copied: ~70k page faults when each block is a fresh mmap; the context does
    # nothing in a process that did not hold its freed heap (a library caller's)
    heap, held, unheld = large_probe("heap"), large_probe("held"), large_probe("unheld")
    assert held > 50000 and unheld > 50000, (held, unheld)
    assert heap < held / 20, (heap, held)
