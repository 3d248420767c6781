"""The between-workflow cache under faults: a race for one entry, a corrupted entry, a read-only cache."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_workflow import CI, QUANTIZED, RESERVOIR, SNAKEMAKE, VERDICT, copy_repo, smk
from vqpipe.store import snakecache

pytestmark = pytest.mark.slow


class FakeCache:
    """Just what ``snakecache.store`` uses of snakemake's OutputFileCache."""

    def __init__(self, path, pairs):
        self.path, self.pairs = Path(path), pairs

    async def get_outputfiles_and_cachefiles(self, job):
        return self.pairs

    def set_permissions(self, entry):
        pass

    def symlink(self, path, outputfile, utime=True):
        os.symlink(path, outputfile)


def test_store_loses_a_race_cleanly(tmp_path):
    """The second store of an entry keeps the first one whole and links it (Snakemake's own
    store nests the second copy inside the first)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    entry = cache / "abc"
    job = SimpleNamespace(rule=SimpleNamespace(name="quantize"))
    for name, content in (("a", b"first"), ("b", b"second")):
        out = tmp_path / name / "artifact"
        out.mkdir(parents=True)
        (out / "x.bin").write_bytes(content)
        asyncio.run(snakecache.store(FakeCache(cache, [(out, entry)]), job))
        assert out.is_symlink() and out.resolve() == entry.resolve()
    assert sorted(p.name for p in entry.iterdir()) == ["x.bin"]
    assert (entry / "x.bin").read_bytes() == b"first"
    assert [p.name for p in cache.iterdir()] == ["abc"]  # no temporary left


def _ran(tree, log):
    """Whether the stage whose log is logs/LOG.log ran in ``tree`` (a cached job writes no log)."""
    path = tree / "logs" / f"{log}.log"
    return path.exists() and path.stat().st_size > 0


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_race_corruption_and_read_only_cache(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(cache)}
    target = RESERVOIR.format("on")

    # Two workflows started together fill the same entries (download, quantize, pack).
    a = copy_repo(tmp_path / "a")
    b = copy_repo(tmp_path / "b", src=a)
    procs = [subprocess.Popen(SNAKEMAKE + [target, "--cores", "1", "--cache", *CI], cwd=t, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for t in (a, b)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    entries = sorted(cache.iterdir())
    assert len(entries) == 3, entries
    for e in entries:  # each whole, nothing nested, and its manifest verifies
        assert not [p for p in e.iterdir() if p.is_dir()], e
        assert subprocess.run([sys.executable, "-c", f"from vqpipe.store import manifest; assert manifest.verify({str(e)!r})"],
                              env={**env, "PYTHONPATH": str(a)}).returncode == 0

    # A bit flipped in the cached quantize artifact: a third workflow takes every upstream
    # artifact from the cache and runs validate, which names the damaged file; no verdict.
    quantized = next(e for e in entries if (e / "quantized.safetensors").exists())
    _flip(quantized / "quantized.safetensors", 5000)
    c = copy_repo(tmp_path / "c", src=a)
    proc = smk(c, VERDICT.format("on"), "--cache", *CI, env=env, check=False)
    assert proc.returncode != 0
    assert not _ran(c, "quantize/tiny/b4-auto") and not _ran(c, "pack/tiny/b4-auto/persist-on")  # cached
    log = (c / f"logs/validate/tiny/b4-auto/persist-on.log").read_text()
    assert "quantized.safetensors" in log and "corrupted" in log, log
    assert not (c / VERDICT.format("on")).exists()
    _flip(quantized / "quantized.safetensors", 5000)  # repaired

    # A read-only cache (a read-only bind mount; root can write through plain permissions):
    # entries are still used, the missing persist-off reservoir is built and kept locally.
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", "-o", "ro", str(cache), str(ro)]).returncode:
        pytest.skip("a read-only bind mount needs root")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        d = copy_repo(tmp_path / "d", src=a)
        targets = [VERDICT.format(p) for p in ("on", "off")]
        proc = smk(d, *targets, "--cache", *CI, env={**env, "SNAKEMAKE_OUTPUT_CACHE": str(ro)})
        assert _ran(d, "pack/tiny/b4-auto/persist-off") and not _ran(d, "pack/tiny/b4-auto/persist-on")
        assert "is not writable" in proc.stdout
        assert (d / RESERVOIR.format("on") / "model.vqres").is_symlink()  # from the cache
        assert not (d / RESERVOIR.format("off") / "model.vqres").is_symlink()  # built here
        assert (d / QUANTIZED / "quantized.safetensors").resolve().is_relative_to(ro)
        for p in ("on", "off"):
            assert json.loads((d / VERDICT.format(p)).read_text())["bit_exact"] is True
        assert sorted(cache.iterdir()) == entries
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_full_cache_is_not_poisoned(tmp_path):
    """A cache on a file system too small for the artifacts: the run succeeds, the outputs stay
    in the working directory, and the cache holds no entry (no partial one)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(cache)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        a = copy_repo(tmp_path / "a")
        proc = smk(a, VERDICT.format("on"), "--cache", *CI, env={**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(cache)})
        assert "is not cached" in proc.stdout
        assert json.loads((a / VERDICT.format("on")).read_text())["bit_exact"] is True
        assert not (a / QUANTIZED).is_symlink() and (a / QUANTIZED / "quantized.safetensors").is_file()
        assert list(cache.iterdir()) == []  # no entry, no temporary
    finally:
        subprocess.run(["umount", "-l", str(cache)], check=True)
