"""Helpers for the tests: run ds-run as a user would, find processes a job left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "e2e" / "scripts"


def ds_run_argv(*args: str) -> list[str]:
    """The ds-run console script of this environment, with ``args``."""
    return [str(Path(sys.executable).with_name("ds-run")), *args]


def processes_mentioning(token: str) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose command line contains ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                "utf-8", "replace")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state = stat[stat.rindex(")") + 2]
        if token in cmdline and state != "Z":
            found.append((int(entry.name), cmdline))
    return found


def wait_until_gone(token: str, timeout: float = 10.0) -> list[tuple[int, str]]:
    """Wait for every process mentioning ``token`` to end; returns the survivors."""
    deadline = time.monotonic() + timeout
    while True:
        left = processes_mentioning(token)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def run_ds(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ds-run to completion and capture its output."""
    return subprocess.run(ds_run_argv(*args), cwd=cwd or ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)


def tagged_json(stdout: str, tag: str) -> dict[int, tuple[str, dict]]:
    """By rank: the ``[host:rank]`` prefix and the JSON of each ``<prefix> TAG {json}``
    line workers printed (the allreduce and env-dump test scripts)."""
    import json

    found = {}
    for line in stdout.splitlines():
        head, _, payload = line.partition(f" {tag} ")
        if payload:
            data = json.loads(payload)
            rank = data["rank"] if "rank" in data else int(data["env"]["RANK"])
            found[rank] = (head, data)
    return found


def require(missing: list[str], what: str, installs: str) -> None:
    """Skip when a piece of infrastructure is missing; in CI (CI=true) fail instead, since
    ``.ci/run`` installs everything the tests need."""
    import pytest

    if not missing:
        return
    message = f"{what} need {', '.join(missing)}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message} (in CI a missing piece is a failure; .ci/run installs "
                    f"{installs})")
    pytest.skip(message)
