"""What the monitor tests share: run a Python snippet in a fresh interpreter (wandb and
comet keep process-wide state and start helper processes), find the processes it left
behind, and read TensorBoard event files with TensorBoard's own reader."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import ROOT

TOKEN_VARIABLE = "DEEPSHARD_MONITOR_TEST_TOKEN"


def run_python(code: str, cwd: Path, env: dict[str, str], timeout: float = 120
               ) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter in ``cwd``, with ``env`` added to a clean
    environment that carries a token every child process inherits."""
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd),
            "PYTHONPATH": str(ROOT), TOKEN_VARIABLE: str(cwd), **env}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=full, text=True,
                          capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)


def processes_left(cwd: Path, wait: float = 5.0) -> list[tuple[int, str]]:
    """Live processes started by a :func:`run_python` in ``cwd`` (by the token in their
    environment), after waiting up to ``wait`` seconds for them to end."""
    needle = f"{TOKEN_VARIABLE}={cwd}".encode()
    deadline = time.monotonic() + wait
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes()
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if needle in environ.split(b"\0") and stat[stat.rindex(")") + 2] != "Z":
                found.append((int(entry.name), (entry / "cmdline").read_bytes().decode(
                    "utf-8", "replace")))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in ``log_dir``'s event files, by tag: (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}
