"""Health monitoring end to end: a killed worker and a hung worker are restarted and the
job completes with exactly the result of an uninterrupted run; exhausted restarts fail
with a summary. Real processes, real gloo, one machine."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.helpers import ROOT, SCRIPTS, ds_run_argv, pid_alive, run_ds

RESUMABLE = str(SCRIPTS / "resumable.py")


def expected(steps: int, world: int) -> float:
    return steps * (steps + 1) / 2 * world * (world + 1) / 2


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def up_time(work: Path, restart: int, world: int) -> float:
    """When the last worker of an attempt came up (wall clock, written by the worker)."""
    return max(float((work / f"up_{restart}_{r}").read_text().split()[1])
               for r in range(world))


def test_killed_worker_is_restarted_and_the_job_completes(job_token, tmp_path):
    steps = 10
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "2", "--max_restarts", "2", RESUMABLE, str(tmp_path),
                    "--steps", str(steps), job_token),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    latest = tmp_path / "latest"
    wait_for(lambda: latest.exists() and int(latest.read_text()) >= 3, proc)
    victim = int((tmp_path / "up_0_1").read_text().split()[0])
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"RESULT {expected(steps, 2)} after 1 restart(s)" in out
    assert "rank 1 on localhost failed first: killed by SIGKILL (signal 9)" in err
    assert "restarting the job in 0.5 s (restart 1 of 2)" in err
    resumed = [line for line in out.splitlines() if "attempt 1 resumes after step" in line]
    assert resumed and int(resumed[0].split()[-1]) >= 3
    latency = up_time(tmp_path, 1, 2) - killed_at
    print(f"SIGKILL -> all ranks running again: {latency:.2f} s")
    assert not pid_alive(victim)


def test_hung_worker_dumps_its_stacks_and_is_restarted(job_token, tmp_path):
    steps = 6
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "2", "--max_restarts", "1", "--hang_timeout", "2",
                    "--log_dir", str(logs), RESUMABLE, str(tmp_path), "--steps", str(steps),
                    "--hang-rank", "1", "--hang-step", "3", job_token),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"RESULT {expected(steps, 2)} after 1 restart(s)" in out
    # rank 0 waits for rank 1 in all_reduce: both stop heartbeating, both dump their stacks
    assert "failed first: hung: no heartbeat for" in err
    assert "rank(s) 0,1" in err or "rank(s) 1" in err
    dump = (logs / "rank_1.log").read_text()
    assert "stuck_in_here" in dump and "File " in dump  # faulthandler's stack dump


def test_restarts_exhausted_fail_with_a_summary(job_token, tmp_path):
    result = run_ds("--num_gpus", "2", "--max_restarts", "2", str(SCRIPTS / "sleeper.py"),
                    str(tmp_path), "--die-rank", "1", "--die-how", "kill", job_token,
                    timeout=120)
    assert result.returncode == 128 + 9, result.stderr
    assert result.stderr.count("rank 1 on localhost failed first: killed by SIGKILL") == 3
    assert "restart 2 of 2" in result.stderr
    assert "giving up after 2 restart(s)" in result.stderr


def test_ctrl_c_is_not_restarted(job_token, tmp_path):
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "2", "--max_restarts", "3", str(SCRIPTS / "sleeper.py"),
                    str(tmp_path), job_token),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(tmp_path.glob("*.pids"))) == 2, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "restarting" not in err


def test_hang_under_a_wrapper_dumps_the_python_stacks(job_token, tmp_path):
    """The worker is a shell running Python: the stack-dump signal goes to the process
    that heartbeat (which registered faulthandler), not to the shell, which it would
    kill."""
    import sys

    result = run_ds("--no_python", "--no_local_rank", "--hang_timeout", "1", "sh", "-c",
                    f"{sys.executable} {SCRIPTS / 'beatblock.py'}; echo {job_token}",
                    timeout=60)
    assert result.returncode == 1, result.stderr
    assert "their Python stacks are in their output and logs" in result.stderr
    assert "blocked_here" in result.stdout


def test_sigterm_during_the_restart_backoff_stops_cleanly(job_token, tmp_path):
    proc = subprocess.Popen(
        ds_run_argv("--num_gpus", "1", "--max_restarts", "5", str(SCRIPTS / "sleeper.py"),
                    str(tmp_path), "--die-rank", "0", "--die-how", "exit3", job_token),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "restarting the job in 2 s (restart 3 of 5)" in line:
            break  # a 2 s backoff: the signal lands in it
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert "SIGTERM received between attempts: not restarting" in err
