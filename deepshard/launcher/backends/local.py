"""The local backend: the agent is a child process of ds-run, its channel a pair of pipes."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from deepshard.launcher.backends.base import AgentHandle, Backend
from deepshard.launcher.plan import NodePlan
from deepshard.launcher.spawn import spawn_agent

if TYPE_CHECKING:
    from deepshard.launcher.options import LaunchOptions


class LocalAgent(AgentHandle):
    def __init__(self, node: NodePlan, proc: subprocess.Popen[bytes]):
        self.node = node
        self._proc = proc
        assert self._proc.stdin is not None
        self._proc.stdin.write(node.to_json().encode("utf-8", "surrogateescape") + b"\n")
        self._proc.stdin.flush()

    def lines(self) -> Iterator[str]:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            yield raw.decode("utf-8", "surrogateescape")

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()

    def wait(self, timeout: float) -> int | None:
        try:
            return self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()


class LocalBackend(Backend):
    """Runs the agent of a node that is this machine."""

    name = "local"

    def __init__(self, python: str = sys.executable,
                 spawned: list[subprocess.Popen[bytes]] | None = None):
        self.python = python
        self._spawned = spawned if spawned is not None else []

    @classmethod
    def from_options(cls, options: LaunchOptions) -> LocalBackend:
        return cls()

    def start(self, node: NodePlan) -> AgentHandle:
        proc = self._spawned.pop() if self._spawned else spawn_agent(self.python)
        return LocalAgent(node, proc)
