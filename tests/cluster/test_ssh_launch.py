"""ds-run over SSH on real sshd hosts (network namespaces), end to end."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from tests.e2e.test_local_launch import contract_lines, wait_for_pids
from tests.helpers import ROOT, SCRIPTS, ds_run_argv, run_ds, tagged_json

ALLREDUCE = str(ROOT / "tests" / "dist" / "scripts" / "allreduce.py")
ENV_DUMP = str(SCRIPTS / "env_dump.py")
SLEEPER = str(SCRIPTS / "sleeper.py")


def test_gloo_allreduce_across_three_hosts(cluster, cluster_env):
    hostfile = cluster.hostfile(slots=[1, 2, 1])
    result = run_ds("-H", str(hostfile), ALLREDUCE, env=cluster_env, timeout=180)
    assert result.returncode == 0, result.stderr
    results = tagged_json(result.stdout, "RESULT")
    assert sorted(results) == [0, 1, 2, 3]
    expected_host = {0: "dsh1", 1: "dsh2", 2: "dsh2", 3: "dsh3"}
    for rank, (head, data) in results.items():
        assert head == f"[{expected_host[rank]}:{rank}]"
        assert data["world"] == 4 and data["sum"] == 10.0
        assert data["gathered"] == [0.0, 1.0, 4.0, 9.0]


def test_ranks_run_on_their_hosts_with_the_contract(cluster, cluster_env):
    hostfile = cluster.hostfile(slots=[1, 2, 1])
    result = run_ds("-H", str(hostfile), ENV_DUMP, env=cluster_env)
    assert result.returncode == 0, result.stderr
    ranks = contract_lines(result.stdout)
    hosts = {r: d["hostname"] for r, d in ranks.items()}
    assert hosts == {0: "dsh1", 1: "dsh2", 2: "dsh2", 3: "dsh3"}
    assert {d["env"]["MASTER_ADDR"] for d in ranks.values()} == {cluster.address(1)}
    assert [ranks[r]["env"]["NODE_RANK"] for r in range(4)] == ["0", "1", "1", "2"]
    assert [ranks[r]["env"]["LOCAL_RANK"] for r in range(4)] == ["0", "0", "1", "0"]
    assert ranks[1]["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert all(d["cwd"] == str(ROOT) for d in ranks.values())


def test_include_and_exclude_across_hosts(cluster, cluster_env):
    hostfile = cluster.hostfile(slots=[1, 2, 1])
    inc = run_ds("-H", str(hostfile), "--include", "dsh3@dsh2:1", ENV_DUMP, env=cluster_env)
    assert inc.returncode == 0, inc.stderr
    ranks = contract_lines(inc.stdout)
    # hostfile order, not selector order: dsh2 (slot 1) first, then dsh3
    assert {r: (d["hostname"], d["env"]["CUDA_VISIBLE_DEVICES"]) for r, d in ranks.items()} \
        == {0: ("dsh2", "1"), 1: ("dsh3", "0")}
    exc = run_ds("-H", str(hostfile), "--exclude", "dsh1@dsh2:0", ENV_DUMP, env=cluster_env)
    assert exc.returncode == 0, exc.stderr
    ranks = contract_lines(exc.stdout)
    assert {r: d["hostname"] for r, d in ranks.items()} == {0: "dsh2", 1: "dsh3"}
    assert ranks[0]["env"]["CUDA_VISIBLE_DEVICES"] == "1"


def test_env_file_values_arrive_verbatim_and_never_run(cluster, cluster_env, tmp_path):
    canary = tmp_path / "pwned"
    nasty = (f"$(touch {canary}) `touch {canary}` 'single' \"double\" two  spaces ; "
             f"touch {canary} | & \\ end")
    (tmp_path / ".deepspeed_env").write_text(f"DSTEST_NASTY={nasty}\nDSTEST_PLAIN=ok\n")
    hostfile = cluster.hostfile(slots=1)
    env = {**cluster_env, "NCCL_DEBUG": "WARN", "DSTEST_NOT_EXPORTED": "x"}
    result = run_ds("-H", str(hostfile), ENV_DUMP, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    ranks = contract_lines(result.stdout)
    assert len(ranks) == 3
    for data in ranks.values():
        extra = {k: bytes.fromhex(v).decode() for k, v in data["extra"].items()}
        assert extra == {"DSTEST_NASTY": nasty, "DSTEST_PLAIN": "ok"}
    assert not canary.exists()


def test_ctrl_c_leaves_no_process_on_any_host(cluster, cluster_env, tmp_path):
    hostfile = cluster.hostfile(slots=[1, 2, 1])
    proc = subprocess.Popen(ds_run_argv("-H", str(hostfile), SLEEPER, str(tmp_path)),
                            cwd=ROOT, env=cluster_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_pids(tmp_path, 4, proc, timeout=60)
    assert set(cluster.stray_pids()) == {"dsh1", "dsh2", "dsh3"}
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert not cluster.wait_no_strays()


def test_failure_on_host_two_tears_down_the_others(cluster, cluster_env, tmp_path):
    hostfile = cluster.hostfile(slots=[1, 2, 1])
    start = time.monotonic()
    result = run_ds("-H", str(hostfile), SLEEPER, str(tmp_path), "--die-rank", "2",
                    "--die-how", "kill", env=cluster_env, timeout=120)
    assert result.returncode == 128 + 9, result.stderr
    assert "rank 2 on dsh2 failed first: killed by SIGKILL (signal 9)" in result.stderr
    assert "[dsh2:2] last words" in result.stderr
    assert not cluster.wait_no_strays()
    assert time.monotonic() - start < 60


def test_coordinator_killed_takes_every_host_down(cluster, cluster_env, tmp_path):
    hostfile = cluster.hostfile(slots=1)
    proc = subprocess.Popen(ds_run_argv("-H", str(hostfile), SLEEPER, str(tmp_path)),
                            cwd=ROOT, env=cluster_env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for_pids(tmp_path, 3, proc, timeout=60)
    proc.kill()
    proc.wait()
    assert not cluster.wait_no_strays(timeout=15)


def _one_line_error(result) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_unreachable_host_fails_fast_and_starts_nothing(cluster, cluster_env, tmp_path):
    cluster.add_alias("dsh-gone", cluster.hosts[0], HostName="198.18.7.99")
    hostfile = cluster.hostfile(slots=1, names=["dsh1", "dsh-gone"])
    marker = tmp_path / "started"
    result = run_ds("-H", str(hostfile), "--ssh_connect_timeout", "2",
                    str(SCRIPTS / "marker.py"), str(marker), env=cluster_env, timeout=60)
    line = _one_line_error(result)
    assert "cannot reach 1 of 2 host(s)" in line and "dsh-gone" in line
    assert "198.18.7.99:22" in line and "HINT:" in line
    assert not marker.exists()


def test_refused_key_is_named(cluster, cluster_env, tmp_path):
    other = cluster.home / ".ssh" / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)],
                   check=True)
    cluster.add_alias("dsh2-badkey", cluster.hosts[1], IdentityFile=str(other))
    hostfile = cluster.hostfile(slots=1, names=["dsh1", "dsh2-badkey"])
    result = run_ds("-H", str(hostfile), ENV_DUMP, env=cluster_env)
    line = _one_line_error(result)
    assert f"dsh2-badkey: cannot reach 1 of 2 host(s): root@{cluster.address(2)}:22 " \
           "refused our keys" in line
    assert "ssh-copy-id root@dsh2-badkey" in line


def test_unknown_host_key_is_refused_then_accept_new_records_it(cluster, cluster_env):
    known = cluster.home / ".ssh" / "known_hosts_new"
    cluster.add_alias("dsh3-new", cluster.hosts[2], UserKnownHostsFile=str(known))
    hostfile = cluster.hostfile(slots=1, names=["dsh3-new"])
    result = run_ds("-H", str(hostfile), ENV_DUMP, env=cluster_env)
    line = _one_line_error(result)
    assert f"the host key of {cluster.address(3)}:22 is not in known_hosts" in line
    assert "ssh dsh3-new" in line
    assert not known.exists()

    cluster.add_alias("dsh3-acceptnew", cluster.hosts[2], UserKnownHostsFile=str(known),
                      StrictHostKeyChecking="accept-new")
    hostfile = cluster.hostfile(slots=1, names=["dsh3-acceptnew"])
    result = run_ds("-H", str(hostfile), ENV_DUMP, env=cluster_env)
    assert result.returncode == 0, result.stderr
    assert known.read_text().startswith(f"{cluster.address(3)} ssh-ed25519 ")


def test_changed_host_key_is_refused(cluster, cluster_env):
    known = cluster.home / ".ssh" / "known_hosts_wrong"
    wrong = (cluster.workdir / "dsh1" / "ssh_host_ed25519_key.pub").read_text().split()
    known.write_text(f"{cluster.address(2)} {wrong[0]} {wrong[1]}\n")
    cluster.add_alias("dsh2-changed", cluster.hosts[1], UserKnownHostsFile=str(known))
    hostfile = cluster.hostfile(slots=1, names=["dsh2-changed"])
    line = _one_line_error(run_ds("-H", str(hostfile), ENV_DUMP, env=cluster_env))
    assert "has CHANGED" in line and f"ssh-keygen -R {cluster.address(2)}" in line


def test_wrong_ssh_port_is_refused(cluster, cluster_env):
    hostfile = cluster.hostfile(slots=1, names=["dsh1"])
    line = _one_line_error(run_ds("-H", str(hostfile), "--ssh_port", "2222", ENV_DUMP,
                                  env=cluster_env))
    assert f"connection refused by {cluster.address(1)}:2222" in line


def test_proxy_jump(cluster, cluster_env):
    cluster.add_alias("dsh3-via-dsh1", cluster.hosts[2], ProxyJump="dsh1")
    hostfile = cluster.hostfile(slots=1, names=["dsh3-via-dsh1"])
    result = run_ds("-H", str(hostfile), ENV_DUMP, env=cluster_env)
    assert result.returncode == 0, result.stderr
    assert contract_lines(result.stdout)[0]["hostname"] == "dsh3"


def test_lost_network_is_detected_and_both_sides_stop(cluster, cluster_env, tmp_path):
    """A host that drops off the network: the coordinator hears nothing for
    --monitor_timeout and stops the job; the cut-off agent hears no ping for as long and
    stops its workers itself."""
    hostfile = cluster.hostfile(slots=1, names=["dsh1", "dsh2"])
    proc = subprocess.Popen(
        ds_run_argv("-H", str(hostfile), "--monitor_timeout", "3", SLEEPER, str(tmp_path)),
        cwd=ROOT, env=cluster_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_pids(tmp_path, 2, proc, timeout=60)
    host = cluster.hosts[1]
    assert host.exec("ip", "link", "set", "eth0", "down").returncode == 0
    try:
        start = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, err
        assert "no word from the agent on dsh2" in err
        assert time.monotonic() - start < 30
        assert not cluster.wait_no_strays(timeout=15)
    finally:
        host.exec("ip", "link", "set", "eth0", "up")


def test_killed_worker_on_a_host_is_restarted_and_the_job_completes(cluster, cluster_env,
                                                                    tmp_path):
    """kill -9 of a worker on dsh2: every host is torn down, the job is relaunched over
    ssh with the restart count, resumes from its checkpoint and ends with the result of an
    uninterrupted run."""
    steps = 8
    hostfile = cluster.hostfile(slots=1)
    proc = subprocess.Popen(
        ds_run_argv("-H", str(hostfile), "--max_restarts", "1", str(SCRIPTS / "resumable.py"),
                    str(tmp_path), "--steps", str(steps)),
        cwd=ROOT, env=cluster_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    latest = tmp_path / "latest"
    deadline = time.monotonic() + 90
    while not (latest.exists() and int(latest.read_text()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    victim = int((tmp_path / "up_0_1").read_text().split()[0])
    assert victim in cluster.hosts[1].pids()  # rank 1 really runs on dsh2
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    world = 3
    assert f"RESULT {steps * (steps + 1) / 2 * world * (world + 1) / 2} after 1 restart(s)" \
        in out
    assert "rank 1 on dsh2 failed first: killed by SIGKILL" in err


def test_host_losing_its_processes_tears_the_job_down(cluster, cluster_env, tmp_path):
    """Every process of dsh2 but its sshd listener dies at once (OOM killer, a crashed
    container): its session ends, the job is stopped everywhere, nothing is left."""
    hostfile = cluster.hostfile(slots=1)
    proc = subprocess.Popen(ds_run_argv("-H", str(hostfile), SLEEPER, str(tmp_path)),
                            cwd=ROOT, env=cluster_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_pids(tmp_path, 3, proc, timeout=60)
    host = cluster.hosts[1]
    for pid in host.pids():
        if pid != host.sshd.pid:
            with contextlib.suppress(ProcessLookupError):  # gone since it was listed
                os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "dsh2" in err.split("failed first")[0]
    assert not cluster.wait_no_strays()


def test_host_that_drops_the_handshake_is_one_line(cluster, cluster_env):
    """A port that accepts and hangs up at once (not an sshd): paramiko's own traceback
    must not leak; the error is one line naming the host."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def hang_up() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        cluster.add_alias("dsh-banner", cluster.hosts[0], HostName="127.0.0.1",
                          Port=str(port))
        hostfile = cluster.hostfile(slots=1, names=["dsh-banner"])
        line = _one_line_error(run_ds("-H", str(hostfile), ENV_DUMP, env=cluster_env))
    finally:
        server.close()
    assert line.startswith("ds-run: error: dsh-banner: cannot reach 1 of 1 host(s)")
    assert "Traceback" not in line
