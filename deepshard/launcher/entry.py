"""The ``ds-run`` console script: starts the local agent early, then runs the CLI.

An agent is a fresh Python process; starting it costs about as much as ds-run's own
imports and planning. When the command line looks like a job on this machine, the agent
is started first (:mod:`.spawn`), so both start-ups overlap; it waits for its node plan on
stdin, and is dismissed without having started anything when planning fails or takes
another path. Only the standard library is imported before that.
"""

from __future__ import annotations

import sys

from deepshard.launcher.spawn import discard_agent, likely_local_run, spawn_agent


def main(argv: list[str] | None = None) -> None:
    """``ds-run ARGS`` (``argv`` defaults to the command line's)."""
    args = sys.argv[1:] if argv is None else argv
    spawned = [spawn_agent()] if likely_local_run(args) else []
    try:
        from deepshard.launcher.cli import run_cli  # after the spawn, on purpose

        code = run_cli(args, spawned)
    except KeyboardInterrupt:  # Ctrl-C before the coordinator took over signals
        code = 130
    finally:
        for proc in spawned:  # not taken by a backend
            discard_agent(proc)
    sys.exit(code)


def deepspeed_main() -> None:
    """The ``deepspeed`` command that ``ds-compat install`` writes: ``ds-run
    --deepspeed_compat`` with DeepSpeed's own command line (``deepspeed --num_gpus 2 train.py
    --deepspeed ds.json``), so scripts and tools that call ``deepspeed`` run on deepshard."""
    main(["--deepspeed_compat", *sys.argv[1:]])
