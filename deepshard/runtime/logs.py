"""DeepSpeed's ``deepspeed.utils.logging`` names over deepshard's logger.

``logger`` is the ``logging.getLogger("deepshard")`` the runtime logs to (``initialize`` gives
it a handler when the script has none). :func:`log_dist` is DeepSpeed's: it prefixes
``[Rank N]`` and logs on the ranks in ``ranks`` (``[-1]``: all); with ``ranks=None`` it logs
only when no process group exists, exactly as DeepSpeed's does. The rank comes from
``torch.distributed`` (no DeepSpeed ``groups``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

__all__ = ["get_dist_msg", "log_dist", "log_dist_once", "logger", "print_dist",
           "set_log_level_from_string"]

logger = logging.getLogger("deepshard")
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}


def get_dist_msg(message: str, ranks: Sequence[int] | None = None) -> str | None:
    """``"[Rank N] message"`` when this process should log it (see the module docstring),
    else ``None``."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else -1
    ranks = list(ranks or [])
    should = not initialized or (bool(ranks) and (ranks[0] == -1 or rank in ranks))
    return f"[Rank {rank}] {message}" if should else None


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` at ``level`` on the ranks in ``ranks`` (see the module docstring)."""
    text = get_dist_msg(message, ranks)
    if text is not None:
        logger.log(level, text)


def print_dist(message: str, ranks: Sequence[int] | None = None) -> None:
    """:func:`log_dist`'s choice of ranks, printed whatever the log level."""
    text = get_dist_msg(message, ranks)
    if text is not None:
        print(text)


@functools.lru_cache(None)
def _log_once(message: str, ranks: tuple[int, ...] | None, level: int) -> None:
    log_dist(message, ranks=ranks, level=level)


def log_dist_once(message: str, ranks: Sequence[int] | None = None,
                  level: int = logging.INFO) -> None:
    """:func:`log_dist`, each distinct message once per process."""
    _log_once(message, tuple(ranks) if ranks is not None else None, level)


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None
                              ) -> None:
    """Set ``custom_logger`` (default :data:`logger`) to ``"debug"``/``"info"``/... ."""
    level = LEVELS.get(log_level_str.lower())
    if level is None:
        raise ValueError(f"Invalid log level {log_level_str!r}; use one of {', '.join(LEVELS)}")
    (custom_logger or logger).setLevel(level)
