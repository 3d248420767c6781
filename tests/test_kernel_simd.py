"""The CPU mat-vec's SIMD kernels against its portable kernel, compiled apart from MLX's build:
AVX2/FMA with the host's g++, NEON with Debian's aarch64 cross compiler run under qemu-aarch64
(scripts/setup.sh installs both on x86-64 Linux). tests/csrc/kernel_check.cpp holds the cases."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

def _include():
    import mlx.core as mx

    return Path(mx.__file__).parent / "include"


def _build_and_run(compiler, out, runner=()):
    cmd = [compiler, "-O2", "-std=c++20", "-I", str(ROOT / "csrc"), "-I", str(_include()),
           str(ROOT / "tests/csrc/kernel_check.cpp"), str(ROOT / "csrc/kernel.cpp"), "-o", str(out)]
    if runner:
        cmd.insert(1, "-static")
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return subprocess.run([*runner, str(out)], capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_host_simd_kernel_equals_portable(tmp_path):
    run = _build_and_run("g++", tmp_path / "kc")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("ok ") and int(run.stdout.split()[2]) == 216


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None or shutil.which("qemu-aarch64") is None,
                    reason="no aarch64 cross compiler or qemu-aarch64 (scripts/setup.sh installs them on x86-64 Linux)")
def test_neon_kernel_equals_portable(tmp_path):
    run = _build_and_run("aarch64-linux-gnu-g++", tmp_path / "kc", ("qemu-aarch64",))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split()[:2] == ["ok", "neon"] and int(run.stdout.split()[2]) == 216
