"""ds-run --elastic_training under a real multi-node SLURM (issue 22): inside ``salloc -N3
--no-kill`` on three hosts (network namespaces), each running its own slurmd, one host dies
with every process on it, its slurmd and job step too; the other nodes' steps go on at world
size 2, the job grows back to 3 when the host's slurmd is back, and the result is one
uninterrupted process's on the same global batches."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.cluster import simcluster, simslurm
from tests.cluster.elastic_job import FAST, TRAIN, Job, close_to, no_job_process, reference
from tests.cluster.simcluster import SimCluster
from tests.cluster.simslurm import SimSlurmCluster
from tests.helpers import ds_run_argv, require


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """Hosts dss1..dss3 (198.18.9.x), a slurmd in each, slurmctld in the root namespace."""
    require(simcluster.missing_tools() + simslurm.missing_tools(),
            "the multi-node SLURM tests", "slurm-wlm, munge, openssh-server and iproute2")
    hosts = SimCluster(3, tmp_path_factory.mktemp("dss_hosts"), prefix="dss", subnet=9)
    slurm = SimSlurmCluster(tmp_path_factory.mktemp("dss_slurm"), cluster=hosts)
    try:
        hosts.start()
        yield slurm.start()
    finally:
        slurm.stop()
        hosts.stop()


def test_lost_node_step_ends_the_others_continue_and_it_rejoins(slurm_cluster, tmp_path):
    steps = 10
    names = [h.name for h in slurm_cluster.cluster.hosts]
    victim = slurm_cluster.cluster.hosts[1]
    env = {**slurm_cluster.env(),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    job = Job(["salloc", "-N3", "--no-kill",
               *ds_run_argv("--launcher", "slurm", *FAST, TRAIN, str(tmp_path), "--steps",
                            str(steps), "--delay", "0.4")], env)
    try:
        job.wait_for("STEP 3 world 3")
        slurm_cluster.cluster.kill_host(victim)
        job.wait_for(f"ds-run: elastic: {victim.name} left (lost")
        slurm_cluster.start_slurmd(victim)
        job.wait_for(f"ds-run: elastic: {victim.name} joined")
        code = job.finish(timeout=120)
    finally:
        if job.proc.poll() is None:
            job.proc.terminate()  # salloc, which then gives the allocation back
            job.finish(timeout=30)
    assert code == 0, job.dump()
    err = "".join(job.err)
    survivors = [n for n in names if n != victim.name]
    assert f"world size 2 on {','.join(survivors)}" in err, err
    assert f"world size 3 on {','.join(names)}" in err, err
    seen = job.steps()
    assert {s for s, _ in seen} == set(range(1, steps + 1)), seen
    assert {w for _, w in seen} in ({2, 3}, {3}), seen  # it may grow before a step at 2
    assert any(w == 3 for s, w in seen if s == steps), seen  # it ended on all three
    assert close_to(job.final(), reference(steps)), (job.final(), reference(steps))
    assert not slurm_cluster.wait_no_jobs(), "the allocation was not released"
    assert not slurm_cluster.wait_no_strays()
    assert not no_job_process(str(tmp_path))
