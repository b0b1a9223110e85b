"""ds-run's tree fan-out on real sshd hosts: ``--fanout 1`` makes dsh1 the relay that starts
and carries dsh2 and dsh3 (a tree of depth 2 below ds-run)."""

from __future__ import annotations

import signal
import subprocess
import time

from tests.cluster.elastic_job import FAST, TRAIN, Job, close_to, reference
from tests.e2e.test_local_launch import wait_for_pids
from tests.helpers import ROOT, SCRIPTS, ds_run_argv, run_ds, tagged_json

ALLREDUCE = str(ROOT / "tests" / "dist" / "scripts" / "allreduce.py")
SLEEPER = str(SCRIPTS / "sleeper.py")


def ssh_peers(host) -> set[str]:
    """The addresses connected to ``host``'s sshd."""
    out = host.exec("ss", "-Htn", "state", "established", "( sport = :22 )").stdout
    return {line.split()[-1].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}


def test_the_relay_starts_its_share_and_carries_its_lines(cluster, cluster_env, tmp_path):
    hostfile = cluster.hostfile(slots=[1, 2, 1])
    proc = subprocess.Popen(ds_run_argv("-H", str(hostfile), "--fanout", "1", SLEEPER,
                                        str(tmp_path)),
                            cwd=ROOT, env=cluster_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_pids(tmp_path, 4, proc, timeout=60)
        # ds-run (the bridge's address) holds one connection: to the relay; the relay
        # holds the others
        relay = cluster.address(1)
        assert ssh_peers(cluster.hosts[0]) == {"198.18.7.1"}
        assert ssh_peers(cluster.hosts[1]) == {relay}
        assert ssh_peers(cluster.hosts[2]) == {relay}
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert not cluster.wait_no_strays()

    result = run_ds("-H", str(hostfile), "--fanout", "1", ALLREDUCE, env=cluster_env,
                    timeout=180)
    assert result.returncode == 0, result.stderr
    results = tagged_json(result.stdout, "RESULT")
    expected_host = {0: "dsh1", 1: "dsh2", 2: "dsh2", 3: "dsh3"}
    assert {r: head for r, (head, _) in results.items()} == {
        r: f"[{h}:{r}]" for r, h in expected_host.items()}
    assert all(d["sum"] == 10.0 and d["world"] == 4 for _, d in results.values())


def test_a_failure_behind_the_relay_tears_down_every_host(cluster, cluster_env, tmp_path):
    hostfile = cluster.hostfile(slots=[1, 2, 1])
    result = run_ds("-H", str(hostfile), "--fanout", "1", SLEEPER, str(tmp_path),
                    "--die-rank", "3", "--die-how", "kill", env=cluster_env, timeout=120)
    assert result.returncode == 128 + 9, result.stderr
    assert "rank 3 on dsh3 failed first: killed by SIGKILL (signal 9)" in result.stderr
    assert "[dsh3:3] last words" in result.stderr
    assert not cluster.wait_no_strays()


def test_a_host_the_relay_cannot_reach_fails_the_launch_before_anything_starts(
        cluster, cluster_env, tmp_path):
    cluster.add_alias("dsh-gone", cluster.hosts[0], HostName="198.18.7.99")
    hostfile = cluster.hostfile(slots=1, names=["dsh1", "dsh2", "dsh-gone"])
    marker = tmp_path / "started"
    result = run_ds("-H", str(hostfile), "--fanout", "1", "--ssh_connect_timeout", "2",
                    str(SCRIPTS / "marker.py"), str(marker), env=cluster_env, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "cannot reach 1 of 3 host(s)" in lines[0] and "dsh-gone" in lines[0]
    assert "(from relay dsh1)" in lines[0] and "HINT:" in lines[0]
    assert not marker.exists()
    assert not cluster.wait_no_strays()


def test_a_lost_relay_is_left_out_and_its_share_gets_another(cluster, cluster_env, tmp_path):
    """Elastic: the relay's host dies; the job names it, goes on with dsh2 relaying dsh3,
    and ends with one uninterrupted process's parameters."""
    steps = 8
    job = Job(ds_run_argv("-H", str(cluster.hostfile(slots=1)), *FAST, "--fanout", "1",
                          TRAIN, str(tmp_path), "--steps", str(steps), "--delay", "0.4"),
              cluster_env)
    victim = cluster.hosts[0]
    try:
        job.wait_for("STEP 2 world 3")
        cluster.kill_host(victim)
        start = time.monotonic()
        job.wait_for("ds-run: elastic: dsh1 left (lost")
        assert time.monotonic() - start < 30
        code = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
        cluster.restart_sshd(victim)
    assert code == 0, job.dump()
    err = "".join(job.err)
    assert "world size 2 on dsh2,dsh3" in err
    assert "dsh2 left" not in err and "dsh3 left" not in err
    assert {s for s, _ in job.steps()} == set(range(1, steps + 1))
    assert close_to(job.final(), reference(steps)), (job.final(), reference(steps))
    assert not cluster.wait_no_strays()
