"""experiments.host_cost: refuses off CUDA with a message; on CUDA every kind is timed in both modes."""

import json

import pytest

from experiments import host_cost
from experiments.step_attribution import on_cuda


def test_refuses_without_cuda():
    if on_cuda():
        pytest.skip("CUDA present")
    with pytest.raises(SystemExit, match="needs the CUDA backend"):
        host_cost.main(["--n", "3", "--rounds", "1"])


@pytest.mark.gpu
def test_times_every_kind(tmp_path):
    if not on_cuda():
        pytest.skip("needs CUDA")
    out = tmp_path / "h.json"
    host_cost.main(["--n", "5", "--rounds", "2", "--out", str(out)])
    doc = json.loads(out.read_text())
    for mode in ("compiled", "eager"):
        assert set(doc[mode]) == {"rms_norm", "custom1", "custom6", "custom-big", "custom-init"}
        assert all(s["n"] == 2 and s["median"] > 0 for s in doc[mode].values())
