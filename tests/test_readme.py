"""The README's commands, as a user runs them after `make run` and `source .venv/bin/activate`.

Every ``$ `` line of a ```console block of README.md is run: on a small stand-in of the same kind
(a 4-bit reservoir of ``synth:tiny`` at the README's path), it must succeed without a warning; on the
default pipeline's own artifacts (results/, when `make run` has built them), it must print the lines
the README quotes under it.
"""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def console_blocks(text):
    """[(command, [quoted output lines])] of every ```console block, in order."""
    out = []
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        for chunk in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, *lines = chunk.rstrip("\n").split("\n")
            out.append((command, [line for line in lines if line.strip()]))
    return out


COMMANDS = console_blocks((REPO / "README.md").read_text())


def user_env():
    """A shell after `source .venv/bin/activate`: the venv first on PATH, no BLAS variables set."""
    drop = ("LD_PRELOAD", "VQPIPE_BLAS", "OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(BIN.parent)
    env["PYTHONPATH"] = str(REPO)  # this checkout's vqpipe, wherever the venv's editable install points
    return env


def reservoir_paths():
    return sorted({p for c, _ in COMMANDS for p in re.findall(r"results/reservoir/[^\s\"']+", c)})


def test_readme_shows_vqpipe_commands():
    assert COMMANDS, "no ```console block with `$ ` commands in README.md"
    names = [shlex.split(c.split("|")[-1])[0] for c, _ in COMMANDS]
    assert "vqpipe" in names
    text = (REPO / "README.md").read_text()
    assert "python -m vqpipe " not in text and "bench_quality`" not in text.split("### Layout")[0]
    from vqpipe.__main__ import STAGES

    for stage in re.findall(r"`vqpipe ([a-z][a-z-]*)", text):
        assert stage in STAGES, f"README names `vqpipe {stage}`, which is not a stage"


def _run(command, cwd, timeout=300):
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=user_env(), capture_output=True, text=True,
                          timeout=timeout)


def _serve(command, cwd):
    """Start a serve command, ask it for its models, stop it; (returncode, stdout, stderr)."""
    port = int(re.search(r"--port (\d+)", command).group(1))
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=user_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    assert r.status == 200
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "serve did not answer in 120 s"
                time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def _check(command, cwd):
    if " serve " in f" {command} ":
        return _serve(command, cwd)
    r = _run(command, cwd)
    return r.returncode, r.stdout, r.stderr


@pytest.fixture(scope="module")
def stand_in(tiny_b4_reservoir, tmp_path_factory):
    """A directory where the README's reservoir paths lead to the tiny 4-bit reservoir."""
    root = tmp_path_factory.mktemp("readme")
    for rel in reservoir_paths():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).symlink_to(tiny_b4_reservoir)
    return root


@pytest.mark.parametrize("command", [c for c, _ in COMMANDS], ids=lambda c: c[:60])
def test_command_runs_without_warnings(stand_in, command):
    rc, out, err = _check(command, stand_in)
    assert rc == 0, err[-3000:]
    assert not re.search(r"warn", err, re.I), err[-3000:]


@pytest.mark.parametrize("command, quoted", [(c, q) for c, q in COMMANDS if q], ids=lambda x: str(x)[:60])
def test_quoted_output_on_the_pipeline_artifacts(command, quoted):
    missing = [p for p in reservoir_paths() if p in command and not (REPO / p).is_dir()]
    if missing:
        pytest.skip(f"{missing[0]} not built (run `make run` first)")
    rc, out, err = _check(command, REPO)
    assert rc == 0, err[-3000:]
    assert "\n".join(quoted) in out, f"README quotes:\n{chr(10).join(quoted)}\nthe command printed:\n{out}"
    assert not re.search(r"warn", err, re.I), err[-3000:]


def test_python_api_block(tiny_source, tiny_b4_reservoir, tmp_path):
    """The README's Python block, in a shell set up as it says (scripts/env.sh), in a directory where
    its paths lead to the tiny model and reservoir: no warning."""
    (block,) = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    for rel, target in (("results/models/tiny/source", tiny_source),
                        ("results/reservoir/tiny/b4-auto/persist-off", tiny_b4_reservoir)):
        assert rel in block
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).symlink_to(target)
    from vqpipe import blas

    env = blas.env_for(blas.choice(), user_env()) if sys.platform.startswith("linux") else user_env()  # scripts/env.sh
    r = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", block], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() and (tmp_path / "tiny.vqres").is_file()
