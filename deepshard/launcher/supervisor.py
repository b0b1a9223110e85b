"""The restart policy: run attempts of a job until one succeeds or restarts run out.

Pure policy over an ``attempt(restart_count) -> Outcome`` callable, so it is unit-tested
with scripted outcomes and no processes. A failure (a worker's exit, a hang, a lost node)
is restartable; a stop the user asked for (Ctrl-C, SIGTERM) and bad input are not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended: ds-run's exit code, and whether a restart may help."""

    code: int
    restartable: bool


def backoff(restart: int) -> float:
    """Seconds to wait before restart number ``restart + 1``: 0.5, 1, 2, 4, then 8."""
    return min(0.5 * 2.0**restart, 8.0)


def supervise(attempt: Callable[[int], Outcome], max_restarts: int, *, err: TextIO,
              sleep: Callable[[float], None] = time.sleep,
              delay: Callable[[int], float] = backoff) -> int:
    """Run ``attempt(0)``, and ``attempt(k)`` again after each restartable failure while
    ``k <= max_restarts``; returns the exit code of the last attempt."""
    for restart in range(max_restarts + 1):
        outcome = attempt(restart)
        if outcome.code == 0 or not outcome.restartable:
            return outcome.code
        if restart == max_restarts:
            if max_restarts:
                err.write(f"ds-run: giving up after {max_restarts} restart(s)\n")
            return outcome.code
        wait = delay(restart)
        err.write(f"ds-run: restarting the job in {wait:g} s "
                  f"(restart {restart + 1} of {max_restarts})\n")
        err.flush()
        sleep(wait)
    raise AssertionError("unreachable: the loop returns")
