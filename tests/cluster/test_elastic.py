"""ds-run --elastic_training on real sshd hosts: a host dies (every process, its sshd too),
the job goes on with the others and grows back when the host returns (under the ssh and the
pdsh launcher); the result is one uninterrupted process's on the same global batches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.cluster.elastic_train import reference
from tests.helpers import ROOT, ds_run_argv, require

TRAIN = str(ROOT / "tests" / "cluster" / "elastic_train.py")
FAST = ("--elastic_training", "--elastic_probe_interval", "0.5", "--monitor_timeout", "3",
        "--max_restarts", "2")


class Job:
    """ds-run in the background, its stderr and stdout collected line by line."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self.out),
                                      (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def wait_for(self, text: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.out + self.err):
            assert self.proc.poll() is None or any(text in x for x in self.out + self.err), \
                self.dump()
            assert time.monotonic() < deadline, f"no {text!r} in time: {self.dump()}"
            time.sleep(0.05)

    def finish(self, timeout: float = 300) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def dump(self) -> str:
        return "".join(self.err[-40:]) + "".join(self.out[-20:])

    def steps(self) -> list[tuple[int, int]]:
        return [(int(p[2]), int(p[4])) for line in self.out
                if len(p := line.split()) == 5 and p[1] == "STEP"]

    def final(self) -> dict:
        line = next(x for x in self.out if " FINAL " in x)
        return json.loads(line.split(" FINAL ", 1)[1])


def close_to(got: dict, want: dict, tol: float = 1e-5) -> bool:
    flat = [(g, w) for k in want for g, w in zip(_flat(got[k]), _flat(want[k]), strict=True)]
    return all(abs(g - w) <= tol * max(1.0, abs(w)) for g, w in flat)


def _flat(value) -> list[float]:
    return [x for v in value for x in _flat(v)] if isinstance(value, list) else [value]


def no_job_process(marker: str) -> list[int]:
    """Processes on this machine (every namespace shares its /proc) whose command line
    names ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmd:
                found.append(int(entry.name))
    return found


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
