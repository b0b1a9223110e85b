"""User-facing errors: one line, saying where, what, and the fix.

Every mistake a user can make in a file, a flag or an environment variable is raised as a
:class:`UsageError`; the CLI renders it as a single line on stderr and exits with code 2.
Internal invariants use ``assert``; user input never does.
"""

from __future__ import annotations

EXIT_USAGE = 2


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
