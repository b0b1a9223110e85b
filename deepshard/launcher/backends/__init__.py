"""Backends start one agent per node; the coordinator only sees :class:`AgentHandle`s.

Backends register by name in :data:`BACKENDS`; ``ds-run --launcher NAME`` picks one.
"""

from __future__ import annotations

from .base import AgentHandle, Backend
from .local import LocalBackend

BACKENDS: dict[str, type[Backend]] = {LocalBackend.name: LocalBackend}

__all__ = ["BACKENDS", "AgentHandle", "Backend", "LocalBackend"]
