"""The backend interface: how an agent is started on a node and how its channel is used."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING

from deepshard.errors import UsageError
from deepshard.launcher.plan import NodePlan

if TYPE_CHECKING:
    from deepshard.launcher.options import LaunchOptions


class HostsUnreachable(UsageError):
    """:meth:`Backend.prepare` could not reach some hosts: ``hosts`` maps each to why
    (elastic training leaves them out; otherwise the launch fails with this one line)."""

    def __init__(self, message: str, *, hosts: dict[str, str], where: str | None = None,
                 hint: str | None = None):
        super().__init__(message, where=where, hint=hint)
        self.hosts = hosts


class AgentHandle(ABC):
    """A running agent, seen through its channel."""

    node: NodePlan
    stop_ends_channel: bool = False
    """After :meth:`stop` the channel may close without ``done`` (pdsh's abort ends every
    session): a closed channel then says nothing about the host."""

    @abstractmethod
    def lines(self) -> Iterator[str]:
        """The agent's protocol lines as they arrive; ends when the channel closes."""

    @abstractmethod
    def stop(self) -> None:
        """Close our side of the channel: the agent stops its workers and exits. Idempotent."""

    @abstractmethod
    def wait(self, timeout: float) -> int | None:
        """The agent's exit code, or ``None`` if it is still running after ``timeout``."""

    @abstractmethod
    def kill(self) -> None:
        """Last resort when the agent does not exit after :meth:`stop`."""

    def ping(self) -> None:  # noqa: B027  (optional: a no-op where the channel cannot be lost)
        """Renew the agent's lease: an agent that hears nothing for its lease stops."""

    def diagnostics(self) -> list[str]:
        """What the agent printed outside the protocol (e.g. why it could not start)."""
        return []

    def lost_with(self) -> str | None:
        """The host whose loss silenced or closed this channel when it is not this node's
        own (a relay of the tree fan-out that carried it); ``None``: the node's own."""
        return None


class Backend(ABC):
    """Starts agents on nodes. Subclasses set ``name`` and implement :meth:`start`; those
    ``--launcher`` chooses (:data:`~deepshard.launcher.backends.BACKENDS`) also implement
    :meth:`from_options`."""

    name: str

    @classmethod
    def from_options(cls, options: LaunchOptions) -> Backend:
        """The backend as ``ds-run --launcher NAME`` and its other flags ask for it."""
        raise NotImplementedError(f"{cls.__name__} is not chosen by --launcher")

    def shown_command(self, node: NodePlan) -> list[str] | None:
        """The command line that starts ``node``'s agent, for ``--dry_run`` (``None``:
        nothing worth showing beyond the plan, e.g. an SSH session's command)."""
        return None

    def prepare(self, nodes: tuple[NodePlan, ...]) -> None:  # noqa: B027
        """Everything that can fail before any worker starts (e.g. opening connections);
        raises :class:`~deepshard.errors.UsageError` naming the host and the fix."""

    @abstractmethod
    def start(self, node: NodePlan) -> AgentHandle:
        """Start the agent for ``node`` and hand it its plan; returns at once."""

    def close(self) -> None:  # noqa: B027
        """Release connections once every agent has exited."""


class Router(Backend):
    """Local nodes to one backend, the others to another (ssh, pdsh)."""

    name = "router"

    def __init__(self, local: Backend, remote: Backend | None):
        self.local = local
        self.remote = remote

    def _for(self, node: NodePlan) -> Backend:
        if node.local:
            return self.local
        assert self.remote is not None, "a remote node needs a remote backend"
        return self.remote

    def prepare(self, nodes: tuple[NodePlan, ...]) -> None:
        self.local.prepare(tuple(n for n in nodes if n.local))
        if self.remote is not None:
            self.remote.prepare(tuple(n for n in nodes if not n.local))

    def start(self, node: NodePlan) -> AgentHandle:
        return self._for(node).start(node)

    def close(self) -> None:
        self.local.close()
        if self.remote is not None:
            self.remote.close()
