"""ds-run under a real SLURM (slurmctld + slurmd + munge on this machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.simslurm import SimSlurm, missing_tools
from tests.helpers import ROOT, SCRIPTS, require, tagged_json

ALLREDUCE = str(ROOT / "tests" / "dist" / "scripts" / "allreduce.py")
WRAPPER = str(ROOT / "hostfiles" / "slurm" / "ds-run.sbatch")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    require(missing_tools(), "the SLURM tests", "slurm-wlm and munge")
    sim = SimSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        yield sim.start()
    finally:
        sim.stop()


@pytest.fixture
def slurm_env(slurm):
    bindir = str(Path(sys.executable).parent)
    return {**slurm.env(), "PATH": f"{bindir}:{os.environ['PATH']}"}


def test_sbatch_wrapper_runs_a_two_rank_gloo_job(slurm_env, tmp_path):
    out = tmp_path / "job.out"
    result = subprocess.run(
        ["sbatch", "--wait", "--nodes=1", "--gpus-per-node=0", f"--output={out}", WRAPPER,
         "--num_gpus", "2", ALLREDUCE], cwd=ROOT, env=slurm_env, capture_output=True,
        text=True, timeout=180)
    text = out.read_text() if out.exists() else ""
    assert result.returncode == 0, result.stderr + text
    results = tagged_json(text, "RESULT")
    assert sorted(results) == [0, 1]
    node = os.uname().nodename.split(".")[0]
    for rank, (head, data) in results.items():
        assert head == f"[{node}:{rank}]"
        assert data["sum"] == 3.0 and data["source"] == "contract"


def test_srun_direct_start_uses_slurm_variables(slurm_env):
    """A script started by srun one task per GPU (no ds-run): init_distributed reads
    SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and the node list."""
    result = subprocess.run(["srun", "--nodes=1", "--ntasks=2", sys.executable, ALLREDUCE],
                            cwd=ROOT, env=slurm_env, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr
    data = [json.loads(line.split("RESULT ", 1)[1]) for line in result.stdout.splitlines()
            if "RESULT " in line]
    assert sorted(d["rank"] for d in data) == [0, 1]
    assert all(d["source"] == "slurm" and d["sum"] == 3.0 for d in data)


def test_dry_run_inside_an_allocation_prints_srun_and_placement(slurm_env):
    ds_run = str(Path(sys.executable).with_name("ds-run"))
    result = subprocess.run(["srun", "--nodes=1", "--ntasks=1", ds_run, "--dry_run",
                             "--num_gpus", "2", ALLREDUCE], cwd=ROOT, env=slurm_env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    node = os.uname().nodename.split(".")[0]
    assert f"agent on {node}: srun --nodes=1 --ntasks=1 --nodelist={node} --overlap" \
        in result.stdout
    assert "2 worker(s) on 1 node(s)" in result.stdout
    assert f"MASTER_ADDR={node}" in result.stdout


def test_usr1_stops_the_job_and_requeues_it(slurm_env, tmp_path):
    out = tmp_path / "job.out"
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--output={out}",
         WRAPPER, "--num_gpus", "1", str(SCRIPTS / "sleeper.py"), str(tmp_path)],
        cwd=ROOT, env=slurm_env, capture_output=True, text=True, timeout=60, check=True)
    job = submitted.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("*.pids")):
            assert time.monotonic() < deadline, out.read_text() if out.exists() else ""
            time.sleep(0.1)
        pids = [int(p) for p in next(tmp_path.glob("*.pids")).read_text().split()]
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm_env,
                       check=True)
        deadline = time.monotonic() + 60
        while True:
            info = subprocess.run(["scontrol", "show", "job", job], env=slurm_env,
                                  capture_output=True, text=True, check=False).stdout
            if "Restarts=1" in info:
                break
            assert time.monotonic() < deadline, info
            time.sleep(0.2)
        log = out.read_text()
        assert "USR1 (time limit or pre-emption): stopping and requeueing" in log
        assert "SIGTERM received, stopping 1 worker(s)" in log
        assert not [p for p in pids if Path(f"/proc/{p}").exists()
                    and Path(f"/proc/{p}/stat").read_text().split(") ")[1][0] != "Z"]
    finally:
        subprocess.run(["scancel", job], env=slurm_env, check=False)
