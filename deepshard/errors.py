"""User-facing errors: one line, saying where, what, and the fix.

Every mistake a user can make in a file, a flag or an environment variable is raised as a
:class:`UsageError`; the CLI renders it as a single line on stderr and exits with code 2,
and so does a worker that leaves one uncaught (:func:`install_exit_hooks`).
Internal invariants use ``assert``; user input never does.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import TracebackType

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


class UsageAssertionError(UsageError, AssertionError):
    """A :class:`UsageError` where DeepSpeed raises ``AssertionError`` (``initialize``
    without a model, ``no_sync`` misuse): code written for DeepSpeed that catches
    ``AssertionError`` still catches it; the message is deepshard's one line."""


class UsageValueError(UsageError, ValueError):
    """A :class:`UsageError` where DeepSpeed raises ``ValueError`` (``save_checkpoint``
    without a directory)."""


def render(exc: UsageError) -> str:
    """The one line a user sees for ``exc``."""
    return f"deepshard: error: {exc}"


def install_exit_hooks() -> None:
    """Make an uncaught :class:`UsageError` one line on stderr and exit code 2.

    Installed when a worker joins the job (``init_distributed``, ``initialize``), so that
    library calls raise exceptions a script can catch, and a script that does not catch
    them ends as the CLI does: ``deepshard: error: ...``, no traceback, exit code 2 (after
    the interpreter's exit handlers, which settle the process groups). Errors raised
    inside autograd hooks reach here as themselves. In another thread (``threading``'s
    hook) the line is printed and the process ends at once with code 2: the job cannot go
    on with a thread missing. Other exceptions keep the hooks that were there. Calling
    this again changes nothing while the hook is still the outermost; torch's
    ``init_process_group`` wraps it in its own, so call it again after that.
    """
    if isinstance(sys.excepthook, _ExitHook):
        return
    sys.excepthook = _ExitHook(sys.excepthook)
    threading.excepthook = _ThreadExitHook(threading.excepthook)


class _ExitHook:
    """``sys.excepthook``: a :class:`UsageError` as one line and exit code 2."""

    def __init__(self, previous: Callable[..., object]):
        self.previous = previous

    def __call__(self, kind: type[BaseException], exc: BaseException,
                 tb: TracebackType | None) -> None:
        if not isinstance(exc, UsageError):
            self.previous(kind, exc, tb)
            return
        print(render(exc), file=sys.stderr, flush=True)
        # the launcher stops the other ranks with SIGTERM meanwhile: one arriving in an
        # exit handler must end this process quietly, not print that handler's traceback
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, _exit_usage)
        atexit._run_exitfuncs()
        flush_stdio()
        os._exit(EXIT_USAGE)


class _ThreadExitHook:
    """``threading.excepthook``: a :class:`UsageError` as one line, then the process ends
    with exit code 2."""

    def __init__(self, previous: Callable[..., object]):
        self.previous = previous

    def __call__(self, args: threading.ExceptHookArgs) -> None:
        if not isinstance(args.exc_value, UsageError):
            self.previous(args)
            return
        print(render(args.exc_value), file=sys.stderr, flush=True)
        flush_stdio()
        os._exit(EXIT_USAGE)


def _exit_usage(signum: int, frame: object) -> None:
    del signum, frame
    flush_stdio()
    os._exit(EXIT_USAGE)


def flush_stdio() -> None:
    """Flush stdout and stderr, whatever state they are in (before ``os._exit``)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
