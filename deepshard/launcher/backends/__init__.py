"""Backends start one agent per node; the coordinator only sees :class:`AgentHandle`s.

``local`` runs agents of nodes that are this machine; the remote backends (``ssh``) are
chosen by ``ds-run --launcher NAME`` and imported only when a remote node exists.
"""

from __future__ import annotations

from .base import AgentHandle, Backend, Router
from .local import LocalBackend

REMOTE_BACKENDS = ("ssh",)

__all__ = ["REMOTE_BACKENDS", "AgentHandle", "Backend", "LocalBackend", "Router"]
