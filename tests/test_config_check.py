"""Config errors before anything runs: one readable line per bad key at ``snakemake -n``, and a
workflow ``snakemake --lint`` finds nothing in."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema", reason="setup installs jsonschema; this interpreter lacks it (e.g. the GPU host)")
import yaml

from vqpipe import config_check

REPO = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(".git", ".venv", "results", "logs", ".snakemake", "__pycache__", ".pytest_cache",
                                "*.egg-info", ".wt", ".dev-*", "docs", "tests")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return Path(shutil.copytree(REPO, tmp_path_factory.mktemp("cfg") / "repo", ignore=IGNORE))


def smk(tree, *args):
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", *args], cwd=tree, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)


def test_source_problems(tmp_path):
    assert config_check.source_problem("synth:tiny") is None
    assert config_check.source_problem("synth:tiny-4bit") is None
    assert config_check.source_problem("hf:org/repo") is None  # the network's answer, not checked
    assert "unknown synth preset 'tiny-lama'" in config_check.source_problem("synth:tiny-lama")
    assert "does not exist" in config_check.source_problem(f"path:{tmp_path}/none")
    assert "config.json is missing" in config_check.source_problem(f"path:{tmp_path}")
    assert "does not exist" in config_check.source_problem(f"gguf:{tmp_path}/x.gguf")
    assert "is not installed" in config_check.source_problem("gguf:pkg:no_such_pkg_xyz/a.gguf")
    assert "bad model source" in config_check.source_problem("synht:tiny")
    lines = config_check.model_problems({"a": {"source": "synth:tiny"}, "b": {"source": "synth:nope"}})
    assert len(lines) == 1 and lines[0].startswith("config key 'models.b.source': unknown synth preset")


def test_schema_error_is_one_line():
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    bad = {"models": {"m": {"source": "synht:tiny"}}, "bits": [4]}
    with pytest.raises(jsonschema.ValidationError) as e:
        jsonschema.Draft202012Validator(schema).validate(bad)
    line = config_check.schema_error(e.value)
    assert "\n" not in line and line.startswith("config key 'models.m.source': 'synht:tiny' is not allowed")
    assert "synth:PRESET" in line


@pytest.mark.parametrize("models, bad", [
    ({"m1": "synth:tiny-lama"}, ["config key 'models.m1.source': unknown synth preset 'tiny-lama'"]),
    ({"ok": "synth:tiny", "m2": "path:/no-such-dir", "m3": "gguf:/no/such.gguf"},
     ["config key 'models.m2.source': model directory /no-such-dir does not exist",
      "config key 'models.m3.source': GGUF file /no/such.gguf"]),
    ({"m4": "synht:tiny"}, ["config key 'models.m4.source': 'synht:tiny' is not allowed here; expected synth:PRESET"]),
])
def test_dry_run_stops_on_a_bad_config(tree, tmp_path, models, bad):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"models": {k: {"source": v} for k, v in models.items()}, "bits": [4]}))
    proc = smk(tree, "-n", "--configfile", str(cfg))
    assert proc.returncode != 0
    for line in bad:
        assert line in proc.stdout, proc.stdout[-3000:]
    assert "Failed validating" not in proc.stdout and "Traceback" not in proc.stdout


def test_default_config_dry_run_and_lint(tree):
    proc = smk(tree, "-n")
    assert proc.returncode == 0, proc.stdout[-3000:]
    proc = smk(tree, "--lint")
    assert proc.returncode == 0 and "Lints for" not in proc.stdout, proc.stdout[-3000:]
