"""``--launcher ssh`` through a tree of relays (:mod:`..tree`, :mod:`..relay`).

ds-run connects only to the relays; each relay's session carries its own agent's lines and,
behind :data:`~deepshard.contract.RELAY_MARK`, those of the hosts it started. This backend
splits that stream into one :class:`~.base.AgentHandle` per host, so the coordinator sees
the same handles as flat (restarts, elastic membership, straggler detection, teardown:
unchanged). A child's ``stop``/``kill`` travel down as commands on the relay's stdin; a
relay's loss closes every handle of its share, each naming the relay (``lost_with``), so
the job fails once with the relay as the cause, and an elastic job leaves the relay out and
re-plans the tree on the hosts left: its share gets another relay.
"""

from __future__ import annotations

import collections
import contextlib
import json
import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from deepshard import contract
from deepshard.errors import UsageError
from deepshard.launcher.backends.base import AgentHandle, Backend
from deepshard.launcher.backends.ssh import (
    STDERR_TAIL,
    HostError,
    SSHBackend,
    agent_command,
    unreachable_error,
)
from deepshard.launcher.plan import NodePlan
from deepshard.launcher.tree import plan_tree, relay_count

if TYPE_CHECKING:
    from deepshard.launcher.backends.ssh import Client
    from deepshard.launcher.options import LaunchOptions

REACH_MARGIN = 60.0
"""Seconds beyond the SSH connect timeout a relay gets to start and reach its share."""
SILENT_RELAY = 3 * contract.ALIVE_INTERVAL
"""A relay that has sent nothing for this long (it says ``alive`` every second) is what
keeps its share silent."""


class _Handle(AgentHandle):
    """One host's agent, seen through its relay's session."""

    def __init__(self, session: RelaySession, node: NodePlan):
        self.node = node
        self.session = session
        self.queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def lines(self) -> Iterator[str]:
        while (line := self.queue.get()) is not None:
            yield line


class _RelayHandle(_Handle):
    """The relay's own agent: its session's stdin and exit status are its own."""

    def stop(self) -> None:
        self.session.send("eof")

    def wait(self, timeout: float) -> int | None:
        return self.session.exit_status(timeout)

    def kill(self) -> None:
        self.session.kill()

    def ping(self) -> None:
        self.session.send("\n")

    def diagnostics(self) -> list[str]:
        return list(self.session.stderr)


class _ChildHandle(_Handle):
    """An agent the relay started: commands go down the relay's stdin."""

    def __init__(self, session: RelaySession, node: NodePlan):
        super().__init__(session, node)
        self.ended = threading.Event()
        self.code: int | None = None
        self.relay_lost = False
        """The relay's channel closed before this host's session was seen to end."""
        self.stderr: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)

    def stop(self) -> None:
        self.session.send(f"stop {self.node.host}\n")

    def wait(self, timeout: float) -> int | None:
        if not self.ended.wait(timeout):
            return None
        return 255 if self.code is None else self.code

    def kill(self) -> None:
        self.session.send(f"kill {self.node.host}\n")

    def diagnostics(self) -> list[str]:
        return list(self.session.stderr if self.lost_with() else self.stderr)

    def lost_with(self) -> str | None:
        session = self.session
        if self.relay_lost or time.monotonic() - session.last_line > SILENT_RELAY:
            return session.relay
        return None


class RelaySession:
    """One relay's SSH session: the payload down, its share's lines split by host."""

    def __init__(self, client: Client, python: str, relay: NodePlan,
                 children: list[tuple[NodePlan, dict[str, object]]], connect_timeout: float):
        self.relay = relay.host
        self.handles: dict[str, _Handle] = {relay.host: _RelayHandle(self, relay)}
        self.handles.update((node.host, _ChildHandle(self, node)) for node, _ in children)
        self.stderr: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
        self.unreachable: dict[str, tuple[str, str]] | None = None
        """The relay's report: the hosts of its share it could not reach (``None``: no
        report, the relay did not start)."""
        self.reached = threading.Event()
        self.closed = threading.Event()
        self.last_line = time.monotonic()
        self._went = False
        payload = {contract.RELAY_KEY: {
            "node": relay.to_json(), "python": python, "connect_timeout": connect_timeout,
            "children": [{"plan": node.to_json(), "target": target}
                         for node, target in children]}}
        self._transport = client.get_transport()
        self._chan = self._transport.open_session()
        self._chan.exec_command(agent_command(relay, python))
        self._chan.sendall(json.dumps(payload, separators=(",", ":")).encode(
            "utf-8", "surrogateescape") + b"\n")
        self._outbox: queue.SimpleQueue[str] = queue.SimpleQueue()
        for target, name in ((self._read, "relay"), (self._read_stderr, "relay-stderr"),
                             (self._write, "relay-writer")):
            threading.Thread(target=target, daemon=True, name=f"{name}-{relay.host}").start()

    # -- down ------------------------------------------------------------------------------
    def send(self, what: str) -> None:
        """A command line, ``"eof"`` or ``"close"``, written in order by one thread (a
        send to a host whose network is gone blocks inside paramiko)."""
        self._outbox.put(what)

    def go(self) -> None:
        """Start the share (once): the relay starts its children and its own workers."""
        if not self._went:
            self._went = True
            self.send("go\n")

    def _write(self) -> None:
        while True:
            what = self._outbox.get()
            try:
                if what == "eof":
                    self._chan.shutdown_write()
                elif what == "close":
                    self._chan.close()
                    return
                else:
                    self._chan.sendall(what.encode())
            except Exception:
                if what == "close":
                    return

    def kill(self) -> None:
        self.send("close")
        with contextlib.suppress(Exception):
            self._transport.sock.close()

    def close(self) -> None:
        """Dismiss the relay (before ``go``: nothing started anywhere)."""
        self.send("eof")
        self.exit_status(5.0)
        self.send("close")

    def exit_status(self, timeout: float) -> int | None:
        if not self._chan.status_event.wait(timeout):
            return None
        code: int = self._chan.recv_exit_status()
        return code

    # -- up --------------------------------------------------------------------------------
    def _read(self) -> None:
        own = self.handles[self.relay]
        with contextlib.suppress(Exception):
            for raw in self._chan.makefile("rb"):
                self.last_line = time.monotonic()
                line = raw.decode("utf-8", "surrogateescape")
                relayed = contract.decode_relayed(line)
                if relayed is None:
                    own.queue.put(line)
                else:
                    self._route(*relayed)
        self.closed.set()
        self.reached.set()
        own.queue.put(None)
        for handle in self.handles.values():
            if isinstance(handle, _ChildHandle) and not handle.ended.is_set():
                handle.relay_lost = True
                handle.queue.put(None)
                handle.ended.set()

    def _route(self, kind: str, host: str, text: str) -> None:
        handle = self.handles.get(host)
        if kind == contract.RELAY_REACH:
            data = json.loads(text)["unreachable"]
            self.unreachable = {h: (str(r), str(hint)) for h, (r, hint) in data.items()}
            self.reached.set()
        elif not isinstance(handle, _ChildHandle):
            return
        elif kind == contract.RELAY_LINE:
            handle.queue.put(text)
        elif kind == contract.RELAY_STDERR:
            text = text.rstrip("\n")
            handle.stderr.append(text)
            sys.stderr.write(f"[{host} agent] {text}\n")
        elif kind == contract.RELAY_END:
            handle.code = json.loads(text).get("code")
            handle.queue.put(None)
            handle.ended.set()

    def _read_stderr(self) -> None:
        with contextlib.suppress(Exception):
            for raw in self._chan.makefile_stderr("rb"):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                self.stderr.append(line)
                sys.stderr.write(f"[{self.relay} agent] {line}\n")


class TreeBackend(Backend):
    """The ssh backend, through relays when the host count (or ``--fanout``) asks for it."""

    name = "ssh"

    def __init__(self, ssh: SSHBackend, fanout: int | None):
        self.ssh = ssh
        self.fanout = fanout
        self._sessions: dict[str, RelaySession] = {}
        """Each remote host's relay session (empty: flat)."""

    @classmethod
    def from_options(cls, options: LaunchOptions) -> TreeBackend:
        return cls(SSHBackend.from_options(options), options.fanout)

    def prepare(self, nodes: tuple[NodePlan, ...]) -> None:
        """Flat: :meth:`SSHBackend.prepare`. Tree: connect to the relays, start them, and
        wait until each has reached its share; one error names every host not reached
        (relays and children alike), and then nothing has started anywhere."""
        for session in set(self._sessions.values()):
            session.close()  # the last attempt's relays, long done
        self._sessions = {}
        hosts = tuple(n.host for n in nodes)
        relays = relay_count(len(hosts), self.fanout)
        targets = {h: self.ssh.target(h) for h in hosts} if relays else {}
        jumps = [h for h, t in targets.items() if t.proxy_jump]
        if jumps and self.fanout is not None:
            raise UsageError(f"host {jumps[0]!r} is reached through ProxyJump, which the "
                             "relays of --fanout do not follow", where="--fanout",
                             hint="drop --fanout (or --fanout 0) to reach every host from "
                                  "here")
        if not relays or jumps:
            self.ssh.prepare(nodes)
            return
        by_host = {n.host: n for n in nodes}
        shares = plan_tree(hosts, relays)
        self.ssh.prepare(tuple(by_host[s.relay] for s in shares))
        sessions = [RelaySession(
            self.ssh.client(s.relay), self.ssh.python, by_host[s.relay],
            [(by_host[c], dict(vars(targets[c]))) for c in s.children],
            self.ssh.connect_timeout) for s in shares]
        failures = self._reached(sessions)
        if failures:
            for session in sessions:
                session.close()
            raise unreachable_error(failures, len(nodes))
        self._sessions = {host: s for s in sessions for host in s.handles}

    def _reached(self, sessions: list[RelaySession]) -> list[HostError]:
        """Every host that a relay (or its relay) could not reach, in plan order."""
        failures = []
        deadline = time.monotonic() + self.ssh.connect_timeout + REACH_MARGIN
        for session in sessions:
            session.reached.wait(max(0.0, deadline - time.monotonic()))
            if session.unreachable is None:
                why = " | ".join(list(session.stderr)[-3:]) or "no answer"
                failures.append(HostError(session.relay, f"the relay agent on "
                                          f"{session.relay} did not start its share: {why}",
                                          f"check that {self.ssh.python} runs deepshard "
                                          f"on {session.relay} (--remote_python)"))
                continue
            failures += [HostError(host, f"{reason} (from relay {session.relay})", hint)
                         for host, (reason, hint) in session.unreachable.items()]
        return failures

    def start(self, node: NodePlan) -> AgentHandle:
        session = self._sessions.get(node.host)
        if session is None:
            return self.ssh.start(node)
        session.go()
        return session.handles[node.host]

    def close(self) -> None:
        for session in set(self._sessions.values()):
            session.kill()
        self._sessions = {}
        self.ssh.close()
