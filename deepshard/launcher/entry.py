"""The ``ds-run`` console script: starts the local agent early, then runs the CLI.

An agent is a fresh Python process; starting it costs about as much as ds-run's own
imports and planning. When the command line looks like a job on this machine, the agent
is started first, so both start-ups overlap; it waits for its node plan on stdin, and is
dismissed without having started anything when planning fails or takes another path.
Only the standard library is imported before that.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's default hostfile, used when it exists
AGENT_ARGS = ("-c", "import sys; from deepshard.launcher.agent import main; sys.exit(main())")
"""How Python starts an agent (``-c`` rather than ``-m``: runpy costs ~7 ms, per host)."""
_NOT_LOCAL = frozenset({"-H", "--hostfile", "--dry_run", "-h", "--help", "--version",
                        "--launcher"})


def spawn_agent(python: str = sys.executable) -> subprocess.Popen[bytes]:
    """Start an agent process that waits for its node plan on stdin.

    ds-run may call this before it has parsed its arguments, so that the agent's
    interpreter start-up overlaps with planning; an agent whose stdin closes before a plan
    arrives exits at once, having started nothing.
    """
    # its own session: a Ctrl-C in the terminal reaches ds-run only, which then stops the
    # agent in order (the agent stops its workers, then reports)
    return subprocess.Popen([python, *AGENT_ARGS], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=True)


def discard_agent(proc: subprocess.Popen[bytes]) -> None:
    """Dismiss an agent that never received a plan."""
    with contextlib.suppress(OSError, ValueError):
        assert proc.stdin is not None
        proc.stdin.close()
    proc.wait()


def likely_local_run(argv: list[str]) -> bool:
    """A guess whether ``argv`` runs workers on this machine (no parsing, so a flag of the
    user's script may make it guess wrong: that costs time, never correctness)."""
    if any(arg.split("=", 1)[0] in _NOT_LOCAL for arg in argv):
        return False
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_JOB_NODELIST"):
        return False  # inside an allocation every agent is an srun step
    return not os.path.exists(DEFAULT_HOSTFILE)


def main() -> None:
    args = sys.argv[1:]
    spawned = [spawn_agent()] if likely_local_run(args) else []
    try:
        from .cli import run_cli  # after the spawn, on purpose

        code = run_cli(args, spawned)
    except KeyboardInterrupt:  # Ctrl-C before the coordinator took over signals
        code = 130
    finally:
        for proc in spawned:  # not taken by a backend
            discard_agent(proc)
    sys.exit(code)
