"""The slurm backend: inside an allocation, each node's agent is one ``srun`` job step.

One step per node (``srun --nodes=1 --ntasks=1 --nodelist=<host>``), so that each agent
has a channel of its own: srun forwards the step's stdin (the node plan, the pings, and
EOF to stop) and returns its stdout, exactly like the local pipe. ``--launcher_args`` are
appended to every srun.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING

from ...errors import UsageError
from ..plan import NodePlan
from ..spawn import AGENT_ARGS
from .base import AgentHandle, Backend
from .local import LocalAgent

if TYPE_CHECKING:
    from ..options import LaunchOptions


def srun_command(node: NodePlan, python: str, launcher_args: str) -> list[str]:
    """The srun line that starts ``node``'s agent."""
    # --overlap: ds-run may itself run in a step (srun --pty bash) holding the resources
    return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node.host}", "--overlap",
            "--quiet", "--kill-on-bad-exit=1", *shlex.split(launcher_args), python,
            *AGENT_ARGS]


class SlurmBackend(Backend):
    """Starts one agent per node of the allocation with srun."""

    name = "slurm"

    def __init__(self, *, remote_python: str | None = None, launcher_args: str = ""):
        self.python = remote_python or sys.executable
        self.launcher_args = launcher_args

    @classmethod
    def from_options(cls, options: LaunchOptions) -> SlurmBackend:
        return cls(remote_python=options.remote_python, launcher_args=options.launcher_args)

    def shown_command(self, node: NodePlan) -> list[str]:
        return srun_command(node, self.python, self.launcher_args)

    def prepare(self, nodes: tuple[NodePlan, ...]) -> None:
        if shutil.which("srun") is None:
            raise UsageError("--launcher slurm, but srun is not on PATH",
                             hint="run inside a SLURM allocation, or use --launcher ssh")

    def start(self, node: NodePlan) -> AgentHandle:
        proc = subprocess.Popen(srun_command(node, self.python, self.launcher_args),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                start_new_session=True)
        return LocalAgent(node, proc)
