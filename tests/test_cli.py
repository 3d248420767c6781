"""The ``vqpipe`` command: usage and exit codes, and the BLAS policy it applies to itself."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vqpipe import __main__ as cli
from vqpipe import blas

REPO = Path(__file__).resolve().parents[1]
VQPIPE = Path(sys.executable).parent / "vqpipe"


def _run(args, env=None):
    return subprocess.run([sys.executable, "-m", "vqpipe", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=REPO)


def test_no_arguments_is_usage_and_status_2():
    r = _run([])
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("usage: vqpipe STAGE") and "bench-quality" in r.stderr


def test_help_and_unknown_stage():
    r = _run(["--help"])
    assert r.returncode == 0 and r.stdout.startswith("usage: vqpipe STAGE")
    r = _run(["bench_quality"])
    assert r.returncode == 2 and "unknown stage 'bench_quality'" in r.stderr and "bench-quality" in r.stderr


def test_stage_usage_names_the_vqpipe_command():
    for stage in ("generate", "report", "inspect"):
        r = _run([stage, "--help"])
        assert r.returncode == 0 and f"usage: vqpipe {stage}" in r.stdout, r.stdout


@pytest.mark.skipif(not VQPIPE.exists(), reason=f"no installed vqpipe command beside {sys.executable}")
def test_installed_command():
    r = subprocess.run([str(VQPIPE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("usage: vqpipe")


def _bare_env():
    """This environment without the BLAS policy's variables: a shell that never sourced scripts/env.sh."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VQPIPE_BLAS", "OPENBLAS_CORETYPE")}
    env["PYTHONPATH"] = str(REPO)
    return env


@pytest.mark.skipif(not blas.openblas_available(), reason="Debian's OpenBLAS is not installed: one setup only")
def test_command_starts_again_under_the_policy(tmp_path):
    """Started without the policy's LD_PRELOAD, the command runs under it, silently."""
    assert blas.preloaded(_bare_env()) == "reference" and blas.choice(_bare_env()) == "openblas"
    r = _run(["report", "--inputs", str(tmp_path), "--out", str(tmp_path / "out")], env=_bare_env())
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    # The same command line again, under the policy's environment: a probe sees both processes.
    probe = ("import sys; sys.argv = ['vqpipe', 'inspect', '--help']; from vqpipe import blas;"
             "print('PRELOAD', blas.preloaded(), flush=True); from vqpipe.__main__ import main; sys.exit(main())")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=_bare_env())
    assert r.returncode == 0 and r.stdout.startswith("PRELOAD reference\nPRELOAD openblas\nusage: vqpipe inspect")
    env = blas.env_for("openblas", _bare_env())
    r = subprocess.run([sys.executable, "-c", "from vqpipe import blas; print(blas.preloaded())"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.stdout.strip() == "openblas"


def test_policy_env(monkeypatch):
    monkeypatch.setenv("VQPIPE_BLAS", "reference")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert cli.policy_env() is None  # already the policy's
    if blas.openblas_available():
        monkeypatch.setenv("VQPIPE_BLAS", "openblas")
        env = cli.policy_env()
        assert env is not None and blas.preloaded(env) == "openblas"


def test_a_policy_that_cannot_be_met_warns(tmp_path):
    if blas.openblas_available():
        pytest.skip("OpenBLAS is installed: VQPIPE_BLAS=openblas can be met")
    env = dict(_bare_env(), VQPIPE_BLAS="openblas")
    r = _run(["report", "--inputs", str(tmp_path), "--out", str(tmp_path / "out")], env=env)
    assert "warning: VQPIPE_BLAS=openblas" in r.stderr
