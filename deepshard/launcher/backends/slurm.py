"""The slurm backend: inside an allocation, each node's agent is one ``srun`` job step.

One step per node (``srun --nodes=1 --ntasks=1 --nodelist=<host>``), so that each agent
has a channel of its own: srun forwards the step's stdin (the node plan, the pings, and
EOF to stop) and returns its stdout, exactly like the local pipe. ``--launcher_args`` are
appended to every srun.

A node that dies does not end its srun: slurmctld learns of it only after SlurmdTimeout
(minutes), and until then srun waits for the step's exit, its stdout open, though the
step's I/O connection is gone. While the job runs, the coordinator's silence check finds
such a node; once the job is stopping (the other nodes' workers fail first, their
collectives cut), a stopped step whose node's slurmd no longer answers is ended here, so
that its channel closes and the node is seen as lost, not as an agent that would not exit.
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from typing import TYPE_CHECKING

from deepshard.errors import UsageError
from deepshard.launcher.backends.base import AgentHandle, Backend
from deepshard.launcher.backends.local import LocalAgent
from deepshard.launcher.plan import NodePlan
from deepshard.launcher.spawn import AGENT_ARGS

if TYPE_CHECKING:
    from deepshard.launcher.options import LaunchOptions

Address = tuple[str, int]


def srun_command(node: NodePlan, python: str, launcher_args: str) -> list[str]:
    """The srun line that starts ``node``'s agent."""
    # --overlap: ds-run may itself run in a step (srun --pty bash) holding the resources
    return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node.host}", "--overlap",
            "--quiet", "--kill-on-bad-exit=1", *shlex.split(launcher_args), python,
            *AGENT_ARGS]


def _scontrol(*args: str) -> str:
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True,
                              timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def slurmd_addresses(hosts: list[str]) -> dict[str, Address]:
    """Each host's slurmd (NodeAddr, SlurmdPort) as scontrol tells; those it does not
    tell are left out."""
    if not hosts:
        return {}
    port = next((line.split("=", 1)[1].strip() for line in _scontrol("show", "config")
                 .splitlines() if line.split("=", 1)[0].strip() == "SlurmdPort"), "")
    if not port.isdigit():
        return {}
    found = {}
    for line in _scontrol("show", "node", "--oneliner", ",".join(hosts)).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("NodeName") in hosts and fields.get("NodeAddr"):
            found[fields["NodeName"]] = (fields["NodeAddr"], int(port))
    return found


def slurmd_answers(address: Address, timeout: float = 2.0) -> bool:
    """Whether a slurmd accepts connections at ``address`` (as srun's launch needs)."""
    try:
        socket.create_connection(address, timeout=timeout).close()
    except OSError:
        return False
    return True


class SlurmAgent(LocalAgent):
    """An agent in an srun step: the local pipe's handle, plus the pings that renew the
    agent's lease (its plan has one: a step's node can be lost like an ssh host), and, once
    stopped, the watch on its node's slurmd (see the module's docstring)."""

    def __init__(self, node: NodePlan, proc: subprocess.Popen[bytes],
                 slurmd: Address | None):
        super().__init__(node, proc)
        self._slurmd = slurmd
        self._gone: list[str] = []
        self._stopped = threading.Event()

    def ping(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # srun gone, or stdin closed
            assert self._proc.stdin is not None
            self._proc.stdin.write(b"\n")
            self._proc.stdin.flush()

    def stop(self) -> None:
        super().stop()
        if self._slurmd is not None and not self._stopped.is_set():
            self._stopped.set()
            threading.Thread(target=self._watch_node, args=(self._slurmd,), daemon=True,
                             name=f"slurmd-{self.node.host}").start()

    def _watch_node(self, slurmd: Address, interval: float = 0.5) -> None:
        while self.wait(timeout=interval) is None:
            if not slurmd_answers(slurmd):
                self._gone.append(f"its slurmd ({slurmd[0]}:{slurmd[1]}) does not answer")
                self.kill()
                return

    def diagnostics(self) -> list[str]:
        return list(self._gone)


class SlurmBackend(Backend):
    """Starts one agent per node of the allocation with srun."""

    name = "slurm"

    def __init__(self, *, remote_python: str | None = None, launcher_args: str = ""):
        self.python = remote_python or sys.executable
        self.launcher_args = launcher_args
        self._slurmds: dict[str, Address] = {}

    @classmethod
    def from_options(cls, options: LaunchOptions) -> SlurmBackend:
        return cls(remote_python=options.remote_python, launcher_args=options.launcher_args)

    def shown_command(self, node: NodePlan) -> list[str]:
        return srun_command(node, self.python, self.launcher_args)

    def prepare(self, nodes: tuple[NodePlan, ...]) -> None:
        if shutil.which("srun") is None:
            raise UsageError("--launcher slurm, but srun is not on PATH",
                             hint="run inside a SLURM allocation, or use --launcher ssh")
        self._slurmds = slurmd_addresses([n.host for n in nodes])

    def start(self, node: NodePlan) -> AgentHandle:
        proc = subprocess.Popen(srun_command(node, self.python, self.launcher_args),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                start_new_session=True)
        return SlurmAgent(node, proc, self._slurmds.get(node.host))
