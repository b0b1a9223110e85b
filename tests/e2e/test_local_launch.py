"""ds-run on this machine, end to end, with real processes."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, SCRIPTS, ds_run_argv, pid_alive, run_ds


def contract_lines(stdout: str) -> dict[int, dict]:
    """The JSON each env_dump worker printed, by rank."""
    found = {}
    for line in stdout.splitlines():
        prefix, _, payload = line.partition(" ENV ")
        if payload:
            data = json.loads(payload)
            found[int(data["env"]["RANK"])] = {**data, "prefix": prefix}
    return found


def wait_for_pids(pid_dir: Path, count: int, proc: subprocess.Popen, timeout: float = 30):
    """Pids (worker, grandchild) written by sleeper.py, once ``count`` ranks are up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(pid_dir.glob("*.pids"))
        if len(files) == count:
            return [int(p) for f in files for p in f.read_text().split()]
        assert proc.poll() is None, f"ds-run ended early: {proc.communicate()}"
        time.sleep(0.05)
    raise AssertionError("workers did not start in time")


def test_readme_demo_trains_the_gpt(tmp_path):
    """``make demo``'s command (fewer steps): the reference-size GPT on 2 CPU workers; with
    ``--plot`` (where matplotlib is installed) rank 0 also draws its loss curve."""
    plot = importlib.util.find_spec("matplotlib") is not None
    png = tmp_path / "loss.png"
    result = run_ds("--num_gpus", "2", "examples/train_gpt.py", "--deepspeed_config",
                    "examples/configs/stage0.json", "--steps", "3",
                    *(["--plot", str(png)] if plot else []), timeout=300)
    assert result.returncode == 0, result.stderr
    losses = [float(line.split()[-1]) for line in result.stdout.splitlines()
              if line.startswith("[localhost:0] step")]
    assert len(losses) == 3
    assert all(8.5 < loss < 9.5 for loss in losses)  # about ln(8192) = 9.01 at the start
    if plot:
        from matplotlib.image import imread

        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert imread(png).shape[:2] == (400, 800)
        assert f"[localhost:0] loss curve written to {png}" in result.stdout


def test_ddp_example_trains():
    result = run_ds("--num_gpus", "2", "examples/train.py", "--steps", "6")
    assert result.returncode == 0, result.stderr
    losses = [float(line.split()[-1]) for line in result.stdout.splitlines()
              if line.startswith("[localhost:0] step")]
    assert len(losses) == 6
    assert "[localhost:0] trained 6 steps on 2 rank(s)" in result.stdout


def test_contract_env_and_args(job_token, tmp_path):
    result = run_ds("--num_gpus", "2", str(SCRIPTS / "env_dump.py"), "a b", "--flag", job_token,
                    cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    ranks = contract_lines(result.stdout)
    assert sorted(ranks) == [0, 1]
    port = ranks[0]["env"]["MASTER_PORT"]
    for rank, data in ranks.items():
        env = data["env"]
        assert data["prefix"] == f"[localhost:{rank}]"
        assert env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["NODE_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] == port and port.isdigit()
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))
        assert env["DEEPSHARD_RESTART_COUNT"] == "0"
        assert data["argv"] == [f"--local_rank={rank}", "a b", "--flag", job_token]
        assert data["cwd"] == str(tmp_path)
    assert ranks[0]["env"]["DEEPSHARD_RUN_ID"] == ranks[1]["env"]["DEEPSHARD_RUN_ID"]


def test_two_jobs_get_different_ports(job_token):
    script = str(SCRIPTS / "env_dump.py")
    ports = {contract_lines(run_ds(script, job_token).stdout)[0]["env"]["MASTER_PORT"]
             for _ in range(3)}
    assert len(ports) == 3


def test_env_file_values_reach_workers_byte_for_byte(job_token, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    canary = tmp_path / "pwned"
    nasty = f"$(touch {canary}); `touch {canary}` 'q' \"d\" \\ ; | & é".encode() + b"\xff"
    (home / ".deepspeed_env").write_bytes(b"DSTEST_HOME=from-home\nDSTEST_BOTH=home\n")
    (work / ".deepspeed_env").write_bytes(
        b"# comment\n\nexport DSTEST_BOTH=cwd\nDSTEST_NASTY=" + nasty + b"\n"
        b"OMP_NUM_THREADS=7\n")
    env = {**os.environ, "HOME": str(home)}
    result = run_ds("--num_gpus", "2", str(SCRIPTS / "env_dump.py"), job_token, cwd=work,
                    env=env)
    assert result.returncode == 0, result.stderr
    for data in contract_lines(result.stdout).values():
        extra = {k: bytes.fromhex(v) for k, v in data["extra"].items()}
        assert extra["DSTEST_NASTY"] == nasty
        assert extra["DSTEST_HOME"] == b"from-home"
        assert extra["DSTEST_BOTH"] == b"cwd"  # the working directory's file wins
        assert data["env"]["OMP_NUM_THREADS"] == "7"  # the user's choice is kept
    assert not canary.exists()


def test_log_dir_and_module_mode(job_token, tmp_path):
    logs = tmp_path / "logs"
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    result = run_ds("--num_gpus", "2", "--log_dir", str(logs), "--module", "env_dump",
                    job_token, env=env)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        text = (logs / f"rank_{rank}.log").read_text()
        assert text.startswith("ENV ") and f'"RANK": "{rank}"' in text


def test_no_python_and_no_local_rank(tmp_path):
    marker = tmp_path / "ran"
    result = run_ds("--no_python", "--no_local_rank", "touch", str(marker), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert marker.exists()


def test_bind_cores_to_rank(job_token):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores to check disjoint binding")
    result = run_ds("--num_gpus", "2", "--bind_cores_to_rank", str(SCRIPTS / "env_dump.py"),
                    job_token)
    assert result.returncode == 0, result.stderr
    ranks = contract_lines(result.stdout)
    per = len(cores) // 2
    assert ranks[0]["affinity"] == cores[:per]
    assert ranks[1]["affinity"] == cores[per:2 * per]
    assert ranks[0]["env"]["OMP_NUM_THREADS"] == str(per)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_every_process(job_token, tmp_path, sig, code):
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "2", str(SCRIPTS / "sleeper.py"), str(tmp_path), job_token),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = wait_for_pids(tmp_path, 2, proc)
    assert all(pid_alive(p) for p in pids)
    proc.send_signal(sig)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert f"{signal.Signals(sig).name} received, stopping 2 worker(s)" in err
    assert not [p for p in pids if pid_alive(p)]


def test_worker_ignoring_sigterm_is_killed_after_grace(job_token, tmp_path):
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "2", str(SCRIPTS / "sleeper.py"), str(tmp_path),
                    "--ignore-term", job_token),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = wait_for_pids(tmp_path, 2, proc)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert not [p for p in pids if pid_alive(p)]


@pytest.mark.parametrize(("how", "code", "reason"), [
    ("kill", 128 + 9, "killed by SIGKILL (signal 9)"),
    ("exit3", 3, "exit code 3"),
])
def test_failed_worker_stops_the_job_and_is_named(job_token, tmp_path, how, code, reason):
    result = run_ds("--num_gpus", "2", str(SCRIPTS / "sleeper.py"), str(tmp_path),
                    "--die-rank", "1", "--die-how", how, job_token)
    assert result.returncode == code, result.stderr
    assert f"rank 1 on localhost failed first: {reason}" in result.stderr
    assert "[localhost:1] last words" in result.stderr.split("failed first")[1]
    pids = [int(p) for f in tmp_path.glob("*.pids") for p in f.read_text().split()]
    assert len(pids) == 4 and not [p for p in pids if pid_alive(p)]


def test_coordinator_killed_takes_the_job_down(job_token, tmp_path):
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "2", str(SCRIPTS / "sleeper.py"), str(tmp_path), job_token),
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = wait_for_pids(tmp_path, 2, proc)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while [p for p in pids if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)]


def test_leftover_grandchild_of_a_finished_job_is_stopped(job_token, tmp_path):
    result = run_ds("--num_gpus", "2", str(SCRIPTS / "sleeper.py"), str(tmp_path),
                    "--exit-leaving-child", job_token)
    assert result.returncode == 0, result.stderr
    pids = [int(p) for f in tmp_path.glob("*.pids") for p in f.read_text().split()]
    assert len(pids) == 4 and not [p for p in pids if pid_alive(p)]


def test_hostfile_naming_this_machine_runs_locally_as_two_nodes(job_token, tmp_path):
    """This machine's hostname and a loopback address start locally (no SSH), each as a
    node of its own, with ranks host-major in file order."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{socket.gethostname()} slots=1\n127.0.0.1 slots=2  # loopback\n")
    result = run_ds("--hostfile", str(hostfile), str(SCRIPTS / "env_dump.py"), job_token)
    assert result.returncode == 0, result.stderr
    ranks = contract_lines(result.stdout)
    assert ranks[0]["prefix"] == f"[{socket.gethostname()}:0]"
    assert [ranks[r]["prefix"] for r in (1, 2)] == ["[127.0.0.1:1]", "[127.0.0.1:2]"]
    assert [ranks[r]["env"]["NODE_RANK"] for r in (0, 1, 2)] == ["0", "1", "1"]
    assert [ranks[r]["env"]["LOCAL_RANK"] for r in (0, 1, 2)] == ["0", "0", "1"]
    assert {ranks[r]["env"]["WORLD_SIZE"] for r in ranks} == {"3"}
    assert ranks[2]["env"]["LOCAL_WORLD_SIZE"] == "2"


def test_closed_stdout_does_not_break_supervision(job_token, tmp_path):
    """`ds-run ... | head -1`: the job still runs to its end and exits 0."""
    marker = tmp_path / "ran"
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "2", str(SCRIPTS / "chatty.py"), str(marker), job_token),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert b"Traceback" not in err
    assert marker.read_text() == "done"
