"""Starting an agent process, and guessing early whether ds-run will need one here.

A leaf: only the standard library, so that ``ds-run`` (:mod:`.entry`) can start the local
agent before it imports anything else, and every backend can name the agent's command
line without importing the CLI.
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
    if proc.stdin is not None:
        with contextlib.suppress(OSError, ValueError):
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
