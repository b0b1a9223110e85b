"""The backend interface: how an agent is started on a node and how its channel is used."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

from ..plan import NodePlan


class AgentHandle(ABC):
    """A running agent, seen through its channel."""

    node: NodePlan

    @abstractmethod
    def lines(self) -> Iterator[str]:
        """The agent's protocol lines as they arrive; ends when the channel closes."""

    @abstractmethod
    def stop(self) -> None:
        """Close the channel: the agent stops its workers and exits. Idempotent."""

    @abstractmethod
    def wait(self, timeout: float) -> int | None:
        """The agent's exit code, or ``None`` if it is still running after ``timeout``."""

    @abstractmethod
    def kill(self) -> None:
        """Last resort when the agent does not exit after :meth:`stop`."""


class Backend(ABC):
    """Starts agents on nodes. Subclasses set ``name`` and implement :meth:`start`."""

    name: str

    @abstractmethod
    def start(self, node: NodePlan) -> AgentHandle:
        """Start the agent for ``node`` and hand it its plan; returns at once."""
