"""``--summary_json``: what a job did, as one JSON file written when ds-run ends.

Written atomically (a temporary file beside it, then a rename), also when the job failed or
was stopped: the exit code, the failure that ended the last attempt, how many attempts ran,
and per rank its step-time statistics and straggler verdicts (:class:`.straggler.StepWatch`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from typing import TYPE_CHECKING

from deepshard.errors import UsageError
from deepshard.launcher.straggler import StepWatch, StragglerPolicy

if TYPE_CHECKING:
    from deepshard.launcher.coordinator import Coordinator

SCHEMA = 1
"""Bumped when a field changes meaning or goes away (new fields do not bump it)."""


class JobRecord:
    """What a job's attempts leave for its summary (runtime state, shared by the attempts)."""

    def __init__(self, run_id: str, policy: StragglerPolicy):
        self.run_id = run_id
        self.steps = StepWatch(policy)
        self.attempts = 0
        self.last: Coordinator | None = None
        self.usage_error: str | None = None

    def attempt_started(self, restart: int) -> StepWatch:
        """A new attempt (``restart`` 0 for the first): the step watch it reports to."""
        self.attempts += 1
        self.steps.new_attempt(restart)
        return self.steps

    def to_json(self, exit_code: int | None) -> dict[str, object]:
        last = self.last
        failure: dict[str, object] | None = None
        if self.usage_error is not None:
            failure = {"reason": self.usage_error}
        elif last is not None and last.failure is not None:
            f = last.failure
            failure = {"host": f.host, "rank": f.rank, "returncode": f.returncode,
                       "reason": f.reason, "lost": f.lost}
        stop = last.stop_signal if last is not None else None
        return {"schema": SCHEMA, "run_id": self.run_id, "exit_code": exit_code,
                "succeeded": exit_code == 0, "attempts": self.attempts, "failure": failure,
                "stop_signal": signal.Signals(stop).name if stop is not None else None,
                **self.steps.to_json()}


def write_summary(path: str, data: dict[str, object]) -> None:
    """Write ``data`` to ``path`` atomically: readers see the old file or the whole new one."""
    path = os.path.abspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def check_summary_path(path: str | None) -> None:
    """``--summary_json`` must name a file ds-run can create (checked before any start)."""
    if path is None:
        return
    where = f"--summary_json {path}"
    if os.path.isdir(path):
        raise UsageError("is a directory", where=where, hint="name a file, e.g. run.json")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"directory {parent} does not exist", where=where,
                         hint="create it first, or name a file in an existing directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot create files in {parent}", where=where,
                         hint="name a file in a writable directory")
