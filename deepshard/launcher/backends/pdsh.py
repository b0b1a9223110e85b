"""The pdsh backend (``--launcher pdsh``), for users who launch through pdsh as with DeepSpeed.

One ``pdsh -S -R ssh`` process runs the agent on every remote host, each picking its own
node plan from the command line by pdsh's ``%h`` substitution; pdsh prefixes every output
line with ``host: ``, which is how the lines are told apart again. pdsh does not forward
stdin, so the plans travel base64-encoded on the command line (visible in ``ps`` on the
hosts, as DeepSpeed's exported variables are); the remote stdin stays open while pdsh
runs, so an agent still stops its workers when its ssh session ends. ssh options come from
pdsh's own settings (``PDSH_SSH_ARGS``, ``PDSH_SSH_ARGS_APPEND``, ``~/.ssh/config``).
"""

from __future__ import annotations

import contextlib
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from deepshard import contract
from deepshard.errors import UsageError
from deepshard.launcher.backends.base import AgentHandle, Backend
from deepshard.launcher.plan import NodePlan
from deepshard.launcher.spawn import AGENT_ARGS

if TYPE_CHECKING:
    from deepshard.launcher.options import LaunchOptions


def pdsh_command(nodes: tuple[NodePlan, ...], python: str, extra: str) -> list[str]:
    """The pdsh command line that starts every node's agent."""
    cwd = nodes[0].cwd
    token = contract.encode_node_plans({n.host: n.to_json() for n in nodes})
    remote = (f"cd {shlex.quote(cwd)} && exec {shlex.join([python, *AGENT_ARGS])} "
              f"{contract.PLANS_FLAG} {token} {contract.HOST_FLAG} %h")
    return ["pdsh", "-S", "-R", "ssh", "-f", "1024", *shlex.split(extra),
            "-w", ",".join(n.host for n in nodes), remote]


class _PdshRun:
    """The one pdsh process, its output split by host."""

    def __init__(self, argv: list[str], hosts: list[str]):
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.queues: dict[str, queue.SimpleQueue[str | None]] = {
            h: queue.SimpleQueue() for h in hosts}
        self.stderr: list[str] = []
        self._stopped = False
        threading.Thread(target=self._demux, daemon=True, name="pdsh-out").start()
        threading.Thread(target=self._errors, daemon=True, name="pdsh-err").start()

    def _demux(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            host, sep, rest = raw.decode("utf-8", "surrogateescape").partition(": ")
            if sep and host in self.queues:
                self.queues[host].put(rest)
        for q in self.queues.values():
            q.put(None)

    def _errors(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.stderr.append(line)
            sys.stderr.write(f"[pdsh] {line}\n")

    def stop(self) -> None:
        """pdsh's own abort: two SIGINTs within a second end every ssh session."""
        if self._stopped or self.proc.poll() is not None:
            return
        self._stopped = True
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
            self.proc.send_signal(signal.SIGINT)


class PdshAgent(AgentHandle):
    stop_ends_channel = True

    def __init__(self, node: NodePlan, run: _PdshRun):
        self.node = node
        self._run = run

    def lines(self) -> Iterator[str]:
        q = self._run.queues[self.node.host]
        while (line := q.get()) is not None:
            yield line
            message = contract.decode_line(line)
            if isinstance(message, contract.Done):
                return

    def stop(self) -> None:
        self._run.stop()

    def wait(self, timeout: float) -> int | None:
        try:
            return self._run.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._run.proc.kill()

    def diagnostics(self) -> list[str]:
        return [s for s in self._run.stderr if self.node.host in s]


class PdshBackend(Backend):
    """Starts the agents of all remote nodes with one pdsh."""

    name = "pdsh"

    def __init__(self, *, remote_python: str | None = None, launcher_args: str = ""):
        self.python = remote_python or sys.executable
        self.launcher_args = launcher_args
        self._run: _PdshRun | None = None
        self._nodes: tuple[NodePlan, ...] = ()

    @classmethod
    def from_options(cls, options: LaunchOptions) -> PdshBackend:
        return cls(remote_python=options.remote_python, launcher_args=options.launcher_args)

    def prepare(self, nodes: tuple[NodePlan, ...]) -> None:
        if shutil.which("pdsh") is None:
            raise UsageError("--launcher pdsh, but pdsh is not installed",
                             hint="install pdsh (apt install pdsh) or use --launcher ssh")
        self.close()  # the previous attempt's pdsh, if any
        self._run = None
        self._nodes = nodes

    def start(self, node: NodePlan) -> AgentHandle:
        if self._run is None:
            argv = pdsh_command(self._nodes, self.python, self.launcher_args)
            self._run = _PdshRun(argv, [n.host for n in self._nodes])
        return PdshAgent(node, self._run)

    def close(self) -> None:
        if self._run is not None and self._run.proc.poll() is None:
            self._run.proc.kill()
            self._run.proc.wait()
