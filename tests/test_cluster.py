"""A real cluster and a real object store: SLURM (Debian slurm-wlm) and S3 (moto_server).

SLURM: scripts/slurm_local.sh starts munged, mariadbd, slurmdbd, slurmctld and slurmd for one
localhost node; the CI config's pipeline up to the persist-off verdict (plus bench-kivi, a benchmark
rule) runs through ``snakemake --executor slurm`` with workflow/profiles/slurm: one job of each
stage rule it passes (test_workflow builds both persist modes locally); sacct must show every
job COMPLETED with exactly the CPUs, memory and time limit the workflow profile (workflow/profiles/default)
sets for its rule; the verdict must be bit-exact; the daemons are stopped afterwards. (docs/reliability.md has the full
CI config's run, benchmarks and report included.)

S3: moto's standalone server (a separate process speaking the S3 protocol on localhost) as the
default storage provider; a second checkout sees the artifacts in the bucket as up to date and
reruns validate on them without running download, quantize or pack.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from test_workflow import CI, REPO, RESERVOIR, VERDICT, copy_repo, job_stats, plan, smk

pytestmark = pytest.mark.slow

DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "sacct", "sbatch")
TARGETS = [VERDICT.format("off"), "results/bench/kivi.json"]
EXPECTED_JOBS = {"download": 1, "quantize": 1, "pack": 1, "validate": 1, "bench_kivi": 1}


def _install_cluster_packages():
    """Debian packages when missing (scripts/setup.sh does this too), as root with apt."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"SLURM test needs {missing} (Debian: slurm-wlm slurmdbd munge mariadb-server, as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "slurm-wlm", "slurmdbd", "munge", "mariadb-server"],
                   check=True, env=env, stdout=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    _install_cluster_packages()
    if os.geteuid() != 0:
        pytest.skip("the SLURM daemons run as root")
    state = tmp_path_factory.mktemp("slurm")
    script = REPO / "scripts" / "slurm_local.sh"
    proc = subprocess.run(["bash", str(script), "start", str(state)], capture_output=True, text=True)
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip())
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        yield state
    finally:
        subprocess.run(["bash", str(script), "stop", str(state)], check=True)
        for pid in state.glob("*.pid"):
            assert not _alive(int(pid.read_text())), f"{pid.stem} still runs"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _time_limit(minutes):
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def test_ci_config_on_slurm(slurm, tmp_path):
    tree = copy_repo(tmp_path / "repo")
    env = {**os.environ, "SLURM_ACCOUNT": "vqpipe-ci", "SLURM_PARTITION": "debug"}
    proc = smk(tree, "--profile", "workflow/profiles/slurm", *CI, "--slurm-init-seconds-before-status-checks", "2",
               *TARGETS, env=env, timeout=1500)
    submitted = dict(re.findall(r"submitted with SLURM jobid (\d+) \(log: \S*/rule_(\w+?)/", proc.stdout))
    counts = {}
    for rule in submitted.values():
        counts[rule] = counts.get(rule, 0) + 1
    assert counts == EXPECTED_JOBS, proc.stdout[-4000:]

    fields = "JobIDRaw,State,ReqCPUS,AllocCPUS,ReqMem,Timelimit,Account,Partition,NNodes"
    out = subprocess.run(["sacct", "-X", "--parsable2", "--noheader", "-j", ",".join(submitted), f"--format={fields}"],
                         capture_output=True, text=True, check=True).stdout
    rows = {r[0]: r for r in (line.split("|") for line in out.strip().splitlines())}
    assert rows.keys() == submitted.keys(), out
    # Resources have one home, the workflow profile, applied on top of the slurm profile.
    profile = yaml.safe_load((tree / "workflow/profiles/default/config.yaml").read_text())
    for jobid, rule in submitted.items():
        want = profile["set-resources"][rule]
        _, state, req_cpus, alloc_cpus, req_mem, limit, account, partition, nodes = rows[jobid]
        assert state == "COMPLETED", (rule, rows[jobid])
        assert int(req_cpus) == int(alloc_cpus) == profile["set-threads"][rule], (rule, rows[jobid])
        assert req_mem == f"{want['mem_mb']}M", (rule, rows[jobid])
        assert limit == _time_limit(want["runtime"]), (rule, rows[jobid])
        assert (account, partition, nodes) == ("vqpipe-ci", "debug", "1"), (rule, rows[jobid])
    assert json.loads((tree / VERDICT.format("off")).read_text())["bit_exact"] is True


# --- S3 -----------------------------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_server(tmp_path):
    """(endpoint URL, boto3 client) of a moto_server process with an empty bucket 'vqpipe'."""
    exe = Path(sys.executable).with_name("moto_server")
    if not exe.exists():
        pytest.fail("moto_server is missing (scripts/setup.sh installs moto[server])")
    port = _free_port()
    log = open(tmp_path / "moto.log", "w")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=url, aws_access_key_id="test", aws_secret_access_key="test",
                          region_name="us-east-1")
    try:
        for _ in range(100):
            try:
                client.create_bucket(Bucket="vqpipe")
                break
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.2)
        else:
            pytest.fail(f"moto_server did not start: {(tmp_path / 'moto.log').read_text()[-2000:]}")
        yield url, client
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_s3_store_shared_by_two_checkouts(s3_server, tmp_path):
    url, client = s3_server
    env = {**os.environ, "SNAKEMAKE_STORAGE_S3_ACCESS_KEY": "test", "SNAKEMAKE_STORAGE_S3_SECRET_KEY": "test"}
    flags = ["--default-storage-provider", "s3", "--default-storage-prefix", "s3://vqpipe/store",
             "--storage-s3-endpoint-url", url, "--shared-fs-usage", "persistence", "software-deployment",
             "sources", "source-cache", "--local-storage-prefix", ".snakemake/storage"]
    targets = [VERDICT.format(p) for p in ("on", "off")]
    a = copy_repo(tmp_path / "a")
    smk(a, *targets, *flags, *CI, env=env)
    keys = {o["Key"]: o["Size"] for o in client.list_objects_v2(Bucket="vqpipe")["Contents"]}
    for p in ("on", "off"):
        assert keys[f"store/{RESERVOIR.format(p)}/model.vqres"] > 0
        assert keys[f"store/{RESERVOIR.format(p)}/manifest.json"] > 0
    assert not (a / "results").exists()

    # A second checkout (sources copied with their times) with no local state: up to date, and a
    # forced validate reads the quantized and reservoir artifacts back from the bucket.
    b = copy_repo(tmp_path / "b", src=a)
    assert plan(b, *targets, *flags, *CI, env=env) == {}
    proc = smk(b, *targets, "--forcerun", "validate", *flags, *CI, env=env)
    assert job_stats(proc.stdout) == {"validate": 2}
    fetched = set(re.findall(r"Retrieving from storage: s3://vqpipe/store/(\S+)", proc.stdout))
    assert {RESERVOIR.format("on"), RESERVOIR.format("off"), "results/quantized/tiny/b4-auto"} <= fetched, fetched
    body = client.get_object(Bucket="vqpipe", Key=f"store/{VERDICT.format('off')}")["Body"].read()
    assert json.loads(body)["bit_exact"] is True
