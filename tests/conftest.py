"""Shared fixtures: synthetic source models, built once per test session with vqpipe.stages.download.

Each fixture returns the Path of a Hugging Face layout model directory (``mlx_lm.load`` works on
it) that also holds ``vqpipe-source.json``. Treat them as read-only: they are shared.
"""

import os

import pytest

from vqpipe.stages.download import fetch

# The suite starts hundreds of Python children (stages, Snakemake jobs, fresh-process benchmark
# arms): let them cache vqpipe's compiled modules instead of compiling them anew each time, as
# they would under a shell that sets PYTHONDONTWRITEBYTECODE (__pycache__ is git-ignored).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The files that take longest (real Snakemake runs) first: under pytest-xdist (make test, one
# file per worker, in this order) they start at once instead of ending the run alone.
FIRST = ("test_workflow.py", "test_cluster.py", "test_cache_faults.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


def _build(tmp_path_factory, source):
    name = source.removeprefix("synth:")
    return fetch(source, tmp_path_factory.mktemp("sources") / name, seed=0)


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory):
    """``synth:tiny``: qwen2, hidden 256, 2 layers, intermediate 4864 (= 19 * 256), vocab 8192."""
    return _build(tmp_path_factory, "synth:tiny")


@pytest.fixture(scope="session")
def tiny_llama_source(tmp_path_factory):
    """``synth:tiny-llama``: llama, hidden 512, 8 heads / 4 KV heads, intermediate 1472 (= 23 * 64)."""
    return _build(tmp_path_factory, "synth:tiny-llama")


@pytest.fixture(scope="session")
def tiny_4bit_source(tmp_path_factory):
    """``synth:tiny-4bit``: ``tiny`` quantized mlx-community style (affine, 4 bits, group 64)."""
    return _build(tmp_path_factory, "synth:tiny-4bit")


@pytest.fixture(scope="session")
def tiny_b4_reservoir(tiny_source, tmp_path_factory):
    """``tiny`` quantized at 4 bits (rotation auto, seed 0) and packed with persist_rotation off:
    the reservoir directory. Built once: serve, bench-decode, decode-step and KIVI tests all read it."""
    from vqpipe.stages import pack, quantize

    root = tmp_path_factory.mktemp("tiny-b4")
    quantize.run(tiny_source, root / "q", bits=4, rotation="auto", progress=lambda *_: None)
    pack.run(root / "q", root / "persist-off", False, progress=lambda *_: None)
    return root / "persist-off"
