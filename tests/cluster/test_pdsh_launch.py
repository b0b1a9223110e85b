"""ds-run --launcher pdsh on the same sshd hosts: DeepSpeed's way of fanning out."""

from __future__ import annotations

import shutil
import signal
import subprocess

import pytest

from tests.e2e.test_local_launch import wait_for_pids
from tests.helpers import ROOT, SCRIPTS, ds_run_argv, require, run_ds, tagged_json

ALLREDUCE = str(ROOT / "tests" / "dist" / "scripts" / "allreduce.py")


@pytest.fixture
def pdsh_env(cluster_env, cluster):
    require([] if shutil.which("pdsh") else ["pdsh"], "the pdsh tests", "pdsh")
    home = cluster.home
    # pdsh runs OpenSSH, which reads the account's ~/.ssh, not $HOME: point it at the test's
    return {**cluster_env, "PDSH_SSH_ARGS_APPEND": f"-F {home}/.ssh/config -o "
            f"UserKnownHostsFile={home}/.ssh/known_hosts"}


def test_pdsh_allreduce_across_hosts(cluster, pdsh_env):
    hostfile = cluster.hostfile(slots=[2, 1, 1])
    result = run_ds("-H", str(hostfile), "--launcher", "pdsh", ALLREDUCE, env=pdsh_env,
                    timeout=180)
    assert result.returncode == 0, result.stderr
    results = tagged_json(result.stdout, "RESULT")
    assert {r: head for r, (head, _) in results.items()} == \
        {0: "[dsh1:0]", 1: "[dsh1:1]", 2: "[dsh2:2]", 3: "[dsh3:3]"}
    assert all(data["sum"] == 10.0 for _, data in results.values())


def test_pdsh_failure_and_ctrl_c_leave_no_process(cluster, pdsh_env, tmp_path):
    hostfile = cluster.hostfile(slots=1)
    (tmp_path / "a").mkdir()
    failed = run_ds("-H", str(hostfile), "--launcher", "pdsh", str(SCRIPTS / "sleeper.py"),
                    str(tmp_path / "a"), "--die-rank", "1", "--die-how", "exit3",
                    env=pdsh_env, timeout=120)
    assert failed.returncode == 3, failed.stderr
    assert "rank 1 on dsh2 failed first: exit code 3" in failed.stderr
    assert not cluster.wait_no_strays()

    (tmp_path / "b").mkdir()
    proc = subprocess.Popen(ds_run_argv("-H", str(hostfile), "--launcher", "pdsh",
                                        str(SCRIPTS / "sleeper.py"), str(tmp_path / "b")),
                            cwd=ROOT, env=pdsh_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_pids(tmp_path / "b", 3, proc, timeout=60)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert not cluster.wait_no_strays()
