"""ds_report --slurm under a real multi-node SLURM: hosts dsr1..dsr3 (network namespaces), a
slurmd in each, slurmctld in the root namespace; one row per node, through srun, and a node
whose slurmd is stopped is its own FAIL row while the others pass."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import simcluster, simslurm
from tests.cluster.simcluster import SimCluster
from tests.cluster.simslurm import SimSlurmCluster
from tests.helpers import ROOT, require

DS_REPORT = str(Path(sys.executable).with_name("ds_report"))


@pytest.fixture(scope="module")
def slurm_nodes(tmp_path_factory):
    """Hosts dsr1..dsr3 (198.18.11.x), a slurmd in each, slurmctld in the root namespace."""
    require(simcluster.missing_tools() + simslurm.missing_tools(),
            "the multi-node SLURM tests", "slurm-wlm, munge, openssh-server and iproute2")
    hosts = SimCluster(3, tmp_path_factory.mktemp("dsr_hosts"), prefix="dsr", subnet=11)
    slurm = SimSlurmCluster(tmp_path_factory.mktemp("dsr_slurm"), cluster=hosts)
    try:
        hosts.start()
        yield slurm.start()
    finally:
        slurm.stop()
        hosts.stop()


@pytest.fixture
def env(slurm_nodes):
    return {**slurm_nodes.env(), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


@contextlib.contextmanager
def slurmd_stopped(slurm: SimSlurmCluster, index: int):
    """The node's slurmd is stopped (slurmctld does not notice: SlurmdTimeout); then back,
    and every job it held up (completing there) gone."""
    host = slurm.cluster.hosts[index]
    slurmd = slurm.slurmds[host.name]
    slurmd.terminate()
    slurmd.wait(timeout=10)
    try:
        yield host.name
    finally:
        slurm.start_slurmd(host)
        assert not slurm.wait_no_jobs(timeout=30), "jobs left after the node came back"
        assert not slurm.wait_no_strays(), "processes left on the nodes"


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def rows(result: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    return {c["host"]: c for c in json.loads(result.stdout)["preflight"]}


def test_named_nodes_outside_an_allocation_one_row_each(slurm_nodes, env):
    start = time.monotonic()
    result = run([DS_REPORT, "-w", "dsr[1-3]"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout[result.stdout.index("preflight"):]
    assert [line.split()[1] for line in table.splitlines() if line.startswith("│ dsr")] == \
        ["dsr1", "dsr2", "dsr3"]
    assert table.count(" ok ") == 3 and "FAIL" not in table
    print(f"ds_report -w of 3 nodes: {time.monotonic() - start:.2f} s")
    assert not slurm_nodes.wait_no_jobs(), "a probe's job was left behind"
    assert not slurm_nodes.wait_no_strays(), "processes left on the nodes"


def test_a_named_node_that_does_not_answer_is_killed_and_its_job_cancelled(slurm_nodes, env):
    with slurmd_stopped(slurm_nodes, 2) as dead:
        start = time.monotonic()
        result = run([DS_REPORT, "-w", "dsr[1-3]", "--timeout", "2"], env)
        took = time.monotonic() - start
        assert result.returncode == 1, result.stdout + result.stderr
        table = result.stdout[result.stdout.index("preflight"):]
        verdicts = {line.split()[1]: line.split()[3] for line in table.splitlines()
                    if line.startswith("│ dsr")}
        assert verdicts == {"dsr1": "ok", "dsr2": "ok", dead: "FAIL"}, table
        assert "no answer within 4 s (srun killed)" in table
        # killed srun: its job is cancelled (completing on the dead node), none runs or waits
        states = subprocess.run(["squeue", "-h", "-o", "%j %t"], env=env, capture_output=True,
                                text=True, check=True).stdout.split("\n")
        assert all(line.split()[1] == "CG" for line in states if line.strip()), states
        assert took < 10, f"the dead node held up the others: {took:.1f} s"
        print(f"ds_report -w with a dead node: {took:.2f} s")


def test_in_an_allocation_a_node_whose_slurmd_is_stopped_is_its_own_row(slurm_nodes, env):
    with slurmd_stopped(slurm_nodes, 1) as dead:
        start = time.monotonic()
        # slurmctld has not noticed: the allocation holds the node
        result = run(["salloc", "-N3", "--no-kill", "--immediate=10", DS_REPORT, "--slurm",
                      "--json", "--timeout", "3", "--master_port", "29517"], env)
        took = time.monotonic() - start
        assert result.returncode == 1, result.stdout + result.stderr
        checks = rows(result)
        assert list(checks) == ["dsr1", "dsr2", "dsr3"]
        assert [checks[n]["ok"] for n in checks] == [True, False, True]
        assert not checks[dead]["reachable"] and checks[dead]["facts"] == {}
        assert checks[dead]["problems"] == ["no answer within 3 s (srun killed)"]
        assert f"scontrol show node {dead}" in checks[dead]["fixes"][0]
        for node in ("dsr1", "dsr3"):
            assert checks[node]["facts"]["cwd"] is True
            assert checks[node]["facts"]["skew"] == 0.0
        assert checks["dsr1"]["facts"]["port_free"] is True
        assert checks["dsr3"]["facts"]["port_free"] is None  # only the first node's port
        assert took < 10, f"the dead node held up the others: {took:.1f} s"
        print(f"salloc + ds_report --slurm with a dead node: {took:.2f} s")
