"""User-facing errors: one line, saying where, what, and the fix.

Every mistake a user can make in a file, a flag or an environment variable is raised as a
:class:`UsageError`; the CLI renders it as a single line on stderr and exits with code 2.
Internal invariants use ``assert``; user input never does.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

EXIT_USAGE = 2
P = ParamSpec("P")
R = TypeVar("R")


class UsageError(Exception):
    """Bad user input, rendered as ``<where>: <message>. HINT: <hint>``.

    Args:
        message: what is wrong, in one sentence without a trailing period.
        where: the location: ``file:line``, a flag (``--include``) or a config key path.
        hint: the exact fix, when there is one.
    """

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.where = where
        self.hint = hint

    def __str__(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.hint:
            text += f". HINT: {self.hint}"
        return " ".join(text.split("\n"))


def exit_on_usage_error(fn: Callable[P, R]) -> Callable[P, R]:
    """For runtime entry points called from users' scripts: a :class:`UsageError` becomes
    one line on stderr and exit code 2, like the CLI's, instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except UsageError as exc:
            print(f"deepshard: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_USAGE) from None

    return wrapper
