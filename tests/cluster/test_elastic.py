"""ds-run --elastic_training on real sshd hosts: a host dies (every process, its sshd too),
the job goes on with the others and grows back when the host returns (under the ssh and the
pdsh launcher); the result is one uninterrupted process's on the same global batches."""

from __future__ import annotations

import shutil

import pytest

from tests.cluster.elastic_job import FAST, TRAIN, Job, close_to, no_job_process, reference
from tests.helpers import ds_run_argv, require


def launcher_env(launcher: str, cluster, cluster_env: dict[str, str]) -> dict[str, str]:
    """ds-run's environment for ``launcher``: pdsh runs OpenSSH, which reads the account's
    ~/.ssh rather than $HOME, so it is pointed at the test's files."""
    if launcher != "pdsh":
        return cluster_env
    require([] if shutil.which("pdsh") else ["pdsh"], "the pdsh tests", "pdsh")
    home = cluster.home
    return {**cluster_env, "PDSH_SSH_ARGS_APPEND": f"-F {home}/.ssh/config -o "
            f"UserKnownHostsFile={home}/.ssh/known_hosts"}


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_lost_host_shrinks_then_grows_back_with_exact_parameters(cluster, cluster_env,
                                                                 tmp_path, launcher):
    steps = 10
    job = Job(ds_run_argv("-H", str(cluster.hostfile(slots=1)), *FAST, "--launcher", launcher,
                          TRAIN, str(tmp_path), "--steps", str(steps), "--delay", "0.4"),
              launcher_env(launcher, cluster, cluster_env))
    try:
        job.wait_for("STEP 3 world 3")
        victim = cluster.hosts[1]
        cluster.kill_host(victim)
        job.wait_for("ds-run: elastic: dsh2 left (lost")
        cluster.restart_sshd(victim)
        job.wait_for("ds-run: elastic: dsh2 joined")
        code = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert code == 0, job.dump()
    err = "".join(job.err)
    assert "world size 2 on dsh1,dsh3" in err and "world size 3 on dsh1,dsh2,dsh3" in err
    seen = job.steps()
    assert {s for s, _ in seen} == set(range(1, steps + 1)), seen
    assert {w for _, w in seen} == {2, 3} or {w for _, w in seen} == {3}, seen
    assert any(w == 3 for s, w in seen if s == steps), seen  # it ended on all three
    assert close_to(job.final(), reference(steps)), (job.final(), reference(steps))
    assert not cluster.wait_no_strays()


def test_a_host_whose_worker_keeps_crashing_is_excluded(cluster, cluster_env, tmp_path):
    steps = 5
    job = Job(ds_run_argv("-H", str(cluster.hostfile(slots=1)), *FAST, TRAIN, str(tmp_path),
                          "--steps", str(steps), "--delay", "0", "--crash-host", "dsh3"),
              cluster_env)
    code = job.finish()
    assert code == 0, job.dump()
    err = "".join(job.err)
    assert "rank 2 on dsh3 failed first: exit code 3" in err
    assert "ds-run: elastic: dsh3 left (its workers failed twice in a row: exit code 3); " \
        "world size 2 on dsh1,dsh2" in err
    assert {s for s, _ in job.steps()} == set(range(1, steps + 1))
    assert close_to(job.final(), reference(steps))
    assert not cluster.wait_no_strays()


@pytest.mark.parametrize("launcher", ["ssh"])
def test_below_the_minimum_ends_with_a_summary_and_no_process(cluster, cluster_env,
                                                              tmp_path, launcher):
    job = Job(ds_run_argv("-H", str(cluster.hostfile(slots=1)), *FAST,
                          "--min_elastic_nodes", "3", "--launcher", launcher, TRAIN,
                          str(tmp_path), "--steps", "200", "--delay", "0.2"), cluster_env)
    try:
        job.wait_for("STEP 2 world 3")
        cluster.kill_host(cluster.hosts[2])
        code = job.finish(timeout=60)
    finally:
        cluster.restart_sshd(cluster.hosts[2])
    assert code != 0, job.dump()
    err = "".join(job.err)
    assert "job failed: dsh3 failed first: lost the agent on dsh3" in err, err
    assert "ds-run: elastic: dsh3 left (lost: lost the agent on dsh3" in err
    assert "fewer than --min_elastic_nodes 3: giving up" in err
    assert not cluster.wait_no_strays()
    assert not no_job_process(str(tmp_path))
