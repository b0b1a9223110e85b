"""Supervision under stress: paused or failing stdout, signals during teardown, a killed
agent, processes that take their grace. Real processes, one machine."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import ROOT, SCRIPTS, ds_run_argv, pid_alive, processes_mentioning, run_ds

GRACEFUL = str(SCRIPTS / "graceful.py")


def _wait_files(directory: Path, pattern: str, count: int, proc: subprocess.Popen,
                timeout: float = 30) -> list[Path]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(directory.glob(pattern))
        if len(found) >= count:
            return found
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"no {pattern} in time")


def test_grace_covers_grandchildren_and_sigterm_comes_once(job_token, tmp_path):
    """A worker that is a shell running Python: the Python gets SIGTERM exactly once and
    the whole grace to save, not a SIGKILL right after its parent shell exits."""
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "2", "--no_python", "--no_local_rank", "sh", "-c",
                    f"{sys.executable} {GRACEFUL} {tmp_path}; echo {job_token}"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_files(tmp_path, "ready_*", 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert sorted(p.name for p in tmp_path.glob("saved_*")) == ["saved_0", "saved_1"]
    assert all(p.read_text() == "1" for p in tmp_path.glob("saved_*"))
    assert "SIGTERM #2" not in out


def test_sighup_stops_the_job_in_order(job_token, tmp_path):
    proc = subprocess.Popen(ds_run_argv("--num_gpus", "2", GRACEFUL, str(tmp_path)),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    pids = [int(p.read_text()) for p in _wait_files(tmp_path, "ready_*", 2, proc)]
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 129, err
    assert len(list(tmp_path.glob("saved_*"))) == 2
    assert not [p for p in pids if pid_alive(p)]


def test_paused_stdout_does_not_fail_a_local_job(job_token, tmp_path):
    """Nothing read from ds-run's stdout for longer than --monitor_timeout: a local agent
    cannot be lost silently, so the job must run on."""
    marker = tmp_path / "ran"
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "2", "--monitor_timeout", "1", str(SCRIPTS / "chatty.py"),
                    str(marker), job_token),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(3.5)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.count(b"line 1999") == 2


def test_signal_is_handled_while_stdout_is_blocked(job_token, tmp_path):
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "2", str(SCRIPTS / "spam.py"), str(tmp_path / "m"),
                    job_token), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_files(tmp_path, "m", 1, proc)
    time.sleep(1.5)  # stdout is not read: every pipe on the way fills up
    proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    deadline = start + 20
    while proc.poll() is None and time.monotonic() < deadline:
        assert proc.stdout is not None
        os.read(proc.stdout.fileno(), 1 << 16)  # drain only so that the exit can be seen
        if time.monotonic() - start > 0.5:
            proc.stdout.close()
            break
    proc.wait(timeout=20)
    assert proc.returncode == 143
    assert time.monotonic() - start < 15


def test_full_stdout_does_not_stop_the_job(job_token, tmp_path):
    marker = tmp_path / "ran"
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            ds_run_argv("--num_gpus", "2", str(SCRIPTS / "chatty.py"), str(marker),
                        job_token), cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True,
            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert marker.read_text() == "done"


def test_killed_agent_leaves_no_worker(job_token, tmp_path):
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "2", str(SCRIPTS / "sleeper.py"), str(tmp_path), job_token),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids_files = _wait_files(tmp_path, "*.pids", 2, proc)
    pids = [int(p) for f in pids_files for p in f.read_text().split()]
    agents = [pid for pid, cmd in processes_mentioning("deepshard.launcher.agent")
              if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1]
              == str(proc.pid)]
    assert len(agents) == 1
    os.kill(agents[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "lost the agent on localhost" in err
    assert not [p for p in pids if pid_alive(p)]


def test_agent_stopped_by_someone_else_is_a_failure(job_token, tmp_path):
    proc = subprocess.Popen(ds_run_argv("--num_gpus", "2", GRACEFUL, str(tmp_path)),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _wait_files(tmp_path, "ready_*", 2, proc)
    agent = next(pid for pid, _ in processes_mentioning("deepshard.launcher.agent")
                 if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1]
                 == str(proc.pid))
    os.kill(agent, signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    assert "the agent on localhost stopped its workers (SIGTERM)" in err


def test_failure_summary_survives_a_ctrl_c_during_teardown(job_token, tmp_path):
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "2", str(SCRIPTS / "sleeper.py"), str(tmp_path),
                    "--ignore-term", "--die-rank", "1", "--die-how", "exit3", job_token),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "last words" in line:
            break
    time.sleep(1.0)  # rank 0 ignores SIGTERM: the agent is in its grace period
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3, err
    assert "rank 1 on localhost failed first: exit code 3" in err


def test_hidden_gpus_stay_hidden(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = run_ds("--num_gpus", "2", str(SCRIPTS / "env_dump.py"), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count('"CUDA_VISIBLE_DEVICES": ""') == 2


def test_long_utf8_line_arrives_intact(tmp_path):
    script = tmp_path / "euro.py"
    script.write_text('print("€" * 100000)\n')
    result = run_ds(str(script))
    assert result.returncode == 0, result.stderr
    text = "".join(line.split("] ", 1)[1] for line in result.stdout.splitlines())
    assert text == "€" * 100000


def test_live_view_on_a_terminal(job_token, tmp_path):
    """On a terminal ds-run draws one row per rank (state, step from the heartbeats,
    memory) below the scrolling output; the final table shows every rank done."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "2", str(SCRIPTS / "resumable.py"), str(tmp_path),
                    "--steps", "8", "--delay", "0.4", job_token),
        cwd=ROOT, stdout=slave, stderr=slave, env={**os.environ, "COLUMNS": "120"})
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: the other side closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=60) == 0
    screen = b"".join(chunks).decode("utf-8", "replace")
    for header in ("rank", "state", "step", "steps/s", "loss", "beat", "RSS"):
        assert header in screen
    assert "GPU mem" not in screen  # CPU slots: no agent reports GPU memory
    assert "[localhost:0] RESULT" in screen
    last_table = screen[screen.rindex("steps/s"):]
    assert last_table.count(" done ") == 2
    assert "running" in screen and re.search(r" \d+\.\ds ", screen)
