"""Faults: SIGKILLed stages, checksum manifests, disk full, readers during replacement.

The full SIGKILL campaign (200 trials per stage) is scripts/crashtest.py; figures in
docs/reliability.md. Snakemake-level cache faults: tests/test_cache_faults.py.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import vqpipe
from experiments import crashtest
from vqpipe.store import fsutil, manifest
from vqpipe.stages import pack, quantize
from vqpipe.store import reservoir as R


@pytest.fixture(scope="module")
def crash_work(tmp_path_factory):
    work = tmp_path_factory.mktemp("crash")
    return work, crashtest.prepare(work)


@pytest.mark.parametrize("stage", crashtest.STAGES)
def test_sigkill_trials(crash_work, stage):
    """Three seeded kills per stage: nothing partial is left, the next run restores the artifact."""
    work, golden = crash_work
    r = crashtest.campaign(stage, 3, 0, work, golden=golden)
    assert r["failures"] == [], r
    assert r["counts"]["recovered"] == 3


def test_check_output_catches_a_partial_artifact(crash_work, tmp_path):
    """The trial's check is not vacuous: a copy missing a file, or with one byte changed, fails it."""
    work, golden = crash_work
    src = work / "golden" / "q"
    good = payload = golden["quantize"][0]
    assert crashtest.check_output(src, good) == "complete"
    bad = tmp_path / "q"
    shutil.copytree(src, bad)
    (bad / "reference.safetensors").unlink()
    assert crashtest.check_output(bad, payload).startswith("wrong")
    shutil.rmtree(bad)
    shutil.copytree(src, bad)
    flip(bad / "config.json", 10)
    assert "corrupted" in crashtest.check_output(bad, payload)


def flip(path, at, bit=0):
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 1 << bit
    path.write_bytes(bytes(data))


# --- manifests ----------------------------------------------------------------------------------


def test_every_artifact_has_a_verifying_manifest(crash_work):
    work, _ = crash_work
    for name in ("source", "q", "r"):
        d = work / "golden" / name
        assert manifest.verify(d) is True
        listed = json.loads((d / manifest.NAME).read_text())["files"]
        assert set(listed) == {p.name for p in d.iterdir() if p.name != manifest.NAME}


def test_flipped_bit_in_any_quantize_file_stops_pack(crash_work, tmp_path):
    """A bit flipped in any file of a (cached) quantize artifact is named before pack reads it."""
    work, _ = crash_work
    src = work / "golden" / "q"
    for i, f in enumerate(sorted(p.name for p in src.iterdir())):
        copy = tmp_path / f"q{i}"
        shutil.copytree(src, copy)
        flip(copy / f, 1000 * i + 7, i % 8)
        with pytest.raises(ValueError, match=f"{f}|manifest") as e:  # a flip in the manifest may rename a file
            pack.run(copy, tmp_path / f"r{i}", persist_rotation=False, progress=lambda *_: None)
        assert not (tmp_path / f"r{i}").exists(), e.value


def test_flipped_bit_in_a_reservoir_dir_stops_validate(crash_work, tmp_path, capsys):
    from vqpipe.stages import validate

    work, _ = crash_work
    res = tmp_path / "r"
    shutil.copytree(work / "golden" / "r", res)
    flip(res / "tokenizer.json", 123)
    rc = validate.main(["--reservoir", str(res), "--reference", str(work / "golden" / "q"),
                        "--out", str(tmp_path / "v.json")])
    assert rc == validate.EXIT_USAGE
    assert "tokenizer.json" in capsys.readouterr().err and not (tmp_path / "v.json").exists()


@pytest.mark.parametrize("name, at", [("model.safetensors", -4096), ("config.json", 2)])
def test_flipped_bit_in_the_source_stops_quantize(tiny_source, tmp_path, capsys, name, at):
    """The source's checksums are computed beside the quantization (a helper thread), not before
    it: a flipped bit is still the error the stage reports, with the file named and nothing
    written, whether the damaged weights were quantized (a weight byte) or the load failed on the
    damage first (config.json no longer JSON)."""
    src = tmp_path / "src"
    shutil.copytree(tiny_source, src)
    assert manifest.verify(src) is True
    flip(src / name, at, 1)
    out = tmp_path / "q"
    rc = quantize.main(["--source", str(src), "--out", str(out), "--bits", "4", "--threads", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "vqpipe quantize: error:" in err and f"{name}: SHA-256" in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == [src]  # no output, no temporary


def test_background_verify_gives_verify_result(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    (d / "x.bin").write_bytes(b"abc")
    assert manifest.Background(d).result() is False  # no manifest: nothing checked
    manifest.write(d)
    assert manifest.Background(d).result() is True
    flip(d / "x.bin", 1)
    check = manifest.Background(d)
    for _ in range(2):  # the error each time it is asked for
        with pytest.raises(manifest.ManifestError, match="x.bin: SHA-256"):
            check.result()


def test_manifest_extra_missing_and_corrupted(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    (d / "x.bin").write_bytes(b"abc")
    (d / ".snakemake_timestamp").write_text("")
    manifest.write(d)
    assert manifest.verify(d)
    (d / "y").mkdir()
    (d / "y" / "z").write_text("1")
    with pytest.raises(manifest.ManifestError, match="z is not in"):
        manifest.verify(d)
    shutil.rmtree(d / "y")
    (d / "x.bin").unlink()
    with pytest.raises(manifest.ManifestError, match="missing"):
        manifest.verify(d)
    (d / manifest.NAME).write_text("{not json")
    with pytest.raises(manifest.ManifestError, match="corrupted manifest"):
        manifest.verify(d)
    assert manifest.verify(tmp_path) is False  # no manifest: not an artifact, nothing to check


# --- disk full ------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (root only): every artifact of synth:tiny is larger."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_disk_full_clear_error_no_partial_artifact(crash_work, small_disk):
    work, _ = crash_work
    golden = work / "golden"
    cases = [
        ("download", ["--source", "synth:tiny", "--out", str(small_disk / "source")], small_disk / "source"),
        ("quantize", ["--source", str(golden / "source"), "--out", str(small_disk / "q")], small_disk / "q"),
        ("pack", ["--quantized", str(golden / "q"), "--out", str(small_disk / "r"), "--persist-rotation", "on"],
         small_disk / "r"),
    ]
    for stage, args, out in cases:
        proc = subprocess.run([sys.executable, "-m", "vqpipe", stage, *args], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(vqpipe.__file__).parents[1])})
        assert proc.returncode == 2, (stage, proc.stderr[-2000:])
        assert f"vqpipe {stage}: error:" in proc.stderr and "No space left on device" in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and str(small_disk) in proc.stderr  # the path is named
        assert list(small_disk.iterdir()) == [], (stage, list(small_disk.iterdir()))  # nothing half-written


# --- readers while a writer replaces ----------------------------------------------------------------

WRITER = textwrap.dedent("""
    import shutil, sys, time
    from pathlib import Path
    from vqpipe.store import fsutil
    mode, target, a, b, n = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
    for i in range(n):
        src = a if i % 2 else b
        if mode == "file":
            with fsutil.atomic_path(target) as tmp:
                shutil.copyfile(src, tmp)
        else:
            with fsutil.atomic_dir(target, manifest=True) as tmp:
                for f in src.iterdir():
                    shutil.copyfile(f, tmp / f.name)
    print("done", flush=True)
""")


def _logits(model):
    out = model(mx.array([[1, 2, 3, 4, 5]], dtype=mx.int32)).astype(mx.float32)
    mx.eval(out)
    return np.array(out).tobytes()


@pytest.fixture(scope="module")
def two_models(crash_work, tmp_path_factory):
    """({seed: reservoir dir}, {logits bytes: seed}) of two different quantizations of one model."""
    work, _ = crash_work
    root, dirs = tmp_path_factory.mktemp("two"), {}
    for seed in (0, 1):
        quantize.run(work / "golden" / "source", root / f"q{seed}", bits=2, seed=seed, progress=lambda *_: None)
        dirs[seed] = root / f"r{seed}"
        pack.run(root / f"q{seed}", dirs[seed], persist_rotation=True, progress=lambda *_: None)
    want = {_logits(vqpipe.load(dirs[s])[0]): s for s in (0, 1)}
    assert len(want) == 2
    return dirs, want


@pytest.mark.parametrize("mode", ["file", "dir"])
def test_readers_see_old_or_new_never_a_mix(two_models, tmp_path, mode):
    """A writer replaces a reservoir (the file, or the whole pack directory) 100 times, alternating
    two models, while this process loads it: every load is one model or the other."""
    dirs, want = two_models
    target = tmp_path / "live"
    shutil.copytree(dirs[0], target)
    a, b = (dirs[0], dirs[1]) if mode == "dir" else (dirs[0] / R.FILE_NAME, dirs[1] / R.FILE_NAME)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, mode, str(target if mode == "dir" else target / R.FILE_NAME), str(a), str(b), "100"],
        env={**os.environ, "PYTHONPATH": str(Path(vqpipe.__file__).parents[1])}, stdout=subprocess.PIPE, text=True)
    seen = {0: 0, 1: 0}
    while writer.poll() is None or sum(seen.values()) < 5:
        try:
            model = R.load_reservoir(target / R.FILE_NAME, model_dir=dirs[0])
        except R.ReservoirError as e:
            if mode == "dir" and "cannot open" in str(e):  # between the two renames of a non-exchanging FS
                continue
            # The loader's own clear refusal when every retry raced a replacement (a slow, loaded
            # machine): no mixed model was returned; the loads after the writer stops must succeed.
            if "replaced by a writer" in str(e) and writer.poll() is None:
                continue
            raise
        seen[want[_logits(model)]] += 1  # KeyError: a mixed model
    assert writer.wait() == 0
    assert seen[0] + seen[1] >= 5
    print(f"{mode}: loads while replacing: {seen}")
