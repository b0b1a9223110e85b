"""A relay: the agent of one host of a tree fan-out (:mod:`.tree`), which also starts the
agents of its share of the hosts and carries their channels.

Started like any agent (``python -c <spawn.AGENT_ARGS>`` over SSH); its first stdin line is
``{"relay": {...}}`` instead of a node plan: its own plan, and each child's plan and SSH
target as ds-run resolved it (so the relay needs no ssh config of its own, only the key
files the targets name). Then:

1. it connects to every child in parallel and reports the hosts it cannot reach (a
   ``RELAY_REACH`` line) before anything starts anywhere, so an unreachable host fails the
   launch as it does flat;
2. on ``go`` it starts each child's agent (one SSH session each, the plan on its stdin) and
   its own workers; every line from a child goes up behind ``RELAY_MARK`` with the child's
   name (:func:`deepshard.contract.encode_relayed`), written in batches by one thread: many
   hosts' heartbeats reach ds-run as one write;
3. ds-run's commands come down its stdin: an empty line renews its lease, ``stop HOST``
   and ``kill HOST`` end one child's session; EOF (ds-run is gone or stops the job) stops
   its own workers and every child, as does its lease running out;
4. it exits once its workers and every child session have ended, waiting at most the stop
   grace plus a margin for a child that does not end: then it closes that child's
   connection, which ends the child agent (it dies with its channel).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from deepshard import contract
from deepshard.launcher.backends.ssh import HostError, SSHBackend, agent_command
from deepshard.launcher.ssh_config import SSHTarget

END_MARGIN = 10.0
"""Seconds beyond the stop grace a relay waits for a stopped child's session to end."""


class NodeAgent(Protocol):
    """What the relay needs of the agent that runs its own workers (:class:`.agent.Agent`,
    handed in by :func:`.agent.main`, which imports this module)."""

    def run(self) -> int: ...
    def renew_lease(self) -> None: ...
    def request_stop(self, reason: str) -> None: ...
    def stop_now(self) -> None: ...


class Upward:
    """The relay's stdout: lines from any thread, written by one thread in batches."""

    def __init__(self, out: BinaryIO):
        self._out = out
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="upward")
        self._thread.start()

    def put(self, line: str) -> None:
        self._queue.put(line.encode("utf-8", "surrogateescape"))

    # the file interface the relay's own Agent writes its protocol lines through
    def write(self, data: bytes) -> int:
        self._queue.put(data)
        return len(data)

    def flush(self) -> None:
        pass

    def _run(self) -> None:
        broken = False
        while True:
            item = self._queue.get()
            batch = []
            while item is not None:
                batch.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch and not broken:
                try:
                    self._out.write(b"".join(batch))
                    self._out.flush()
                except (OSError, ValueError):
                    broken = True  # ds-run is gone: our stdin's EOF stops us
            if item is None:
                return

    def close(self) -> None:
        """Write what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout=10.0)


class Child:
    """One child host's agent, on one SSH session of the relay's connection to it.

    The agent process starts at once and waits for its plan (sent by :meth:`begin` on
    ``go``): its interpreter starts while ds-run waits for the other relays. Dismissed
    before its plan (the session closed), it exits having started nothing.
    """

    def __init__(self, host: str, client: Any, command: str, up: Upward):
        self.host = host
        self._up = up
        self._client = client
        self._chan = client.get_transport().open_session()
        self._chan.exec_command(command)
        self._lock = threading.Lock()  # paramiko sends from several threads otherwise
        self.ended = threading.Event()
        threading.Thread(target=self._stderr, daemon=True, name=f"stderr-{host}").start()
        threading.Thread(target=self._stdout, daemon=True, name=f"stdout-{host}").start()

    def begin(self, plan: str) -> None:
        """Send the agent its plan: it starts its workers."""
        self._send(lambda: self._chan.sendall(plan.encode("utf-8", "surrogateescape") + b"\n"))

    def _stdout(self) -> None:
        with contextlib.suppress(Exception):
            for raw in self._chan.makefile("rb"):
                self._up.put(contract.encode_relayed(
                    contract.RELAY_LINE, self.host, raw.decode("utf-8", "surrogateescape")))
        code = None
        if self._chan.status_event.wait(2.0):
            code = self._chan.recv_exit_status()
        self._up.put(contract.encode_relayed(contract.RELAY_END, self.host,
                                             json.dumps({"code": code})))
        self.ended.set()

    def _stderr(self) -> None:
        with contextlib.suppress(Exception):
            for raw in self._chan.makefile_stderr("rb"):
                self._up.put(contract.encode_relayed(
                    contract.RELAY_STDERR, self.host, raw.decode("utf-8", "replace")))

    def _send(self, action: Callable[[], object]) -> None:
        with self._lock, contextlib.suppress(Exception):
            action()

    def ping(self) -> None:
        self._send(lambda: self._chan.sendall(b"\n"))

    def stop(self) -> None:
        """EOF on the child agent's stdin: it stops its workers and exits."""
        self._send(self._chan.shutdown_write)

    def kill(self) -> None:
        """Drop the connection: the child's sshd ends the session, which ends its agent."""
        with contextlib.suppress(Exception):
            self._client.get_transport().sock.close()
        with contextlib.suppress(Exception):
            self._client.close()


class Relay:
    """Runs one relay (see the module docstring); :meth:`run` returns its exit code."""

    def __init__(self, payload: dict[str, Any], out: BinaryIO,
                 make_agent: Callable[[Any, BinaryIO], NodeAgent],
                 read_plan: Callable[[str], Any]):
        self._read_plan = read_plan
        self.node = read_plan(payload["node"])
        self._children_specs: list[dict[str, Any]] = payload["children"]
        self._python: str = payload["python"]
        self._ssh = SSHBackend(connect_timeout=float(payload["connect_timeout"]),
                               config_path=Path(os.devnull))
        self.up = Upward(out)
        self.agent = make_agent(self.node, self.up)  # type: ignore[arg-type]
        self.children: dict[str, Child] = {}
        self._go = threading.Event()
        self._stopped = threading.Event()
        self._last_heard = time.monotonic()

    # -- phase 1: reach every child ----------------------------------------------------------
    def reach(self) -> dict[str, list[str]]:
        """Connect to every child in parallel; the ones that failed, with reason and hint."""
        def connect(spec: dict[str, Any]) -> tuple[str, Any]:
            fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                      for k, v in spec["target"].items()}
            target = SSHTarget(**fields)
            try:
                client = self._ssh.connect(target)
            except HostError as exc:
                return target.alias, exc
            command = agent_command(self._read_plan(spec["plan"]), self._python)
            return target.alias, Child(target.alias, client, command, self.up)

        unreachable: dict[str, list[str]] = {}
        specs = self._children_specs
        with ThreadPoolExecutor(max_workers=max(1, min(64, len(specs)))) as pool:
            for host, result in pool.map(connect, specs):
                if isinstance(result, HostError):
                    unreachable[host] = [result.reason, result.hint]
                else:
                    self.children[host] = result
        self.up.put(contract.encode_relayed(contract.RELAY_REACH, self.node.host,
                                            json.dumps({"unreachable": unreachable})))
        return unreachable

    # -- ds-run's commands -------------------------------------------------------------------
    def listen(self) -> None:
        """Read ds-run's commands from stdin until EOF (on a thread of its own)."""
        pending = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(0, 1 << 12):
                self._last_heard = time.monotonic()
                self.agent.renew_lease()
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._command_line(line.decode("utf-8", "replace").strip())
        self.stop_everything("channel closed")

    def _command_line(self, line: str) -> None:
        verb, _, host = line.partition(" ")
        if verb == "go":
            self._go.set()
        elif verb in ("stop", "kill") and host in self.children:
            child = self.children[host]
            child.stop() if verb == "stop" else child.kill()

    def stop_everything(self, reason: str) -> None:
        """Stop our workers and every child (from any thread, once)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._go.set()  # a relay stopped before ``go`` starts nothing
        self.agent.request_stop(reason)
        for child in list(self.children.values()):
            child.stop()

    def _keep_alive(self) -> None:
        """Ping the children every second; stop them all when ds-run's lease runs out."""
        lease = self.node.lease_timeout
        while not self._stopped.wait(contract.ALIVE_INTERVAL):
            for child in self.children.values():
                child.ping()
            if lease and time.monotonic() - self._last_heard > lease:
                self.stop_everything("the coordinator is unreachable")

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> int:
        threading.Thread(target=self.listen, daemon=True, name="commands").start()
        try:
            if self.reach():
                return 0  # ds-run fails the launch: nothing started anywhere
            self._go.wait()
            if self._stopped.is_set():
                return 0
            specs = {s["target"]["alias"]: s["plan"] for s in self._children_specs}
            for host, child in self.children.items():
                child.begin(specs[host])
            threading.Thread(target=self._keep_alive, daemon=True, name="pings").start()
            code = self.agent.run()
            self._wait_children()
            return code
        finally:
            for child in self.children.values():
                child.kill()
            self._ssh.close()
            self.up.close()

    def _wait_children(self) -> None:
        """Until every child's session ended: the ones still running when the relay was
        stopped get the stop grace and a margin, then their connections are dropped."""
        while not self._stopped.is_set():
            if all(c.ended.wait(0.5) for c in self.children.values()):
                return
        deadline = time.monotonic() + self.node.stop_grace + END_MARGIN
        for child in self.children.values():
            child.ended.wait(max(0.0, deadline - time.monotonic()))


def main(payload: dict[str, Any], out: BinaryIO,
         make_agent: Callable[[Any, BinaryIO], NodeAgent], read_plan: Callable[[str], Any]
         ) -> int:
    """Run a relay whose payload (``{"relay": ...}``'s value) came on stdin; its own workers
    run in ``make_agent(plan, out)``, plans are read by ``read_plan``."""
    import signal

    relay = Relay(payload, out, make_agent, read_plan)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: relay.stop_everything(
            signal.Signals(signum).name))
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        return relay.run()
    except BaseException:
        relay.agent.stop_now()
        raise
