"""The ssh backend: one agent per remote host over paramiko, no external binary.

Connections to every host are opened in parallel before anything starts, so an
unreachable host, a refused key or an unknown host key fails the launch at once, naming
the host and the reason, with no worker started anywhere. Each agent then runs as the
remote command ``cd <cwd> && exec <python> -c <agent bootstrap>`` of one session
without a pty: its node plan, environment included, travels as JSON on the session's
stdin (data, never shell), and closing the session delivers EOF to the agent, which then
stops its workers. Only the working directory and the Python path are in the command
line, each through ``shlex.quote``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import queue
import shlex
import socket
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from deepshard.launcher.backends.base import AgentHandle, Backend, HostsUnreachable
from deepshard.launcher.plan import NodePlan
from deepshard.launcher.spawn import AGENT_ARGS
from deepshard.launcher.ssh_config import (
    SSHTarget,
    import_paramiko,
    load_config_text,
    parse_config,
    parse_jump,
    resolve_target,
)

if TYPE_CHECKING:
    from typing import Any

    from deepshard.launcher.options import LaunchOptions

    Client = Any
    """A ``paramiko.SSHClient`` (paramiko ships no type information)."""

STDERR_TAIL = 20


class HostError(Exception):
    """Why one host could not be reached; ``hint`` is the fix."""

    def __init__(self, host: str, reason: str, hint: str):
        super().__init__(f"{host}: {reason}")
        self.host, self.reason, self.hint = host, reason, hint


def unreachable_error(failures: list[HostError], hosts: int) -> HostsUnreachable:
    """The one error for every host of ``failures`` (out of ``hosts``) that cannot be reached."""
    first = failures[0]
    more = "".join(f"; {f.host}: {f.reason}" for f in failures[1:])
    return HostsUnreachable(f"cannot reach {len(failures)} of {hosts} host(s): "
                            f"{first.reason}{more}", where=first.host, hint=first.hint,
                            hosts={f.host: f.reason for f in failures})


def agent_command(node: NodePlan, python: str) -> str:
    """The remote shell command that becomes the agent."""
    return f"cd {shlex.quote(node.cwd)} && exec {shlex.join([python, *AGENT_ARGS])}"


class RemoteAgent(AgentHandle):
    """An agent on the other end of one SSH session.

    Everything sent to it goes through one writer thread: a send to a host whose network
    is gone blocks inside paramiko, and must not block the coordinator.
    """

    def __init__(self, node: NodePlan, client: Client, python: str):
        self.node = node
        self._transport = client.get_transport()
        self._chan = self._transport.open_session()
        self._chan.exec_command(agent_command(node, python))
        self._chan.sendall(node.to_json().encode("utf-8", "surrogateescape") + b"\n")
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
        self._outbox: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=self._relay_stderr, daemon=True,
                         name=f"stderr-{node.host}").start()
        threading.Thread(target=self._write, daemon=True, name=f"writer-{node.host}").start()

    def _write(self) -> None:
        while True:
            what = self._outbox.get()
            try:
                if what == "ping":
                    self._chan.sendall(b"\n")
                elif what == "eof":
                    self._chan.shutdown_write()
                else:  # "close": the last thing sent
                    self._chan.close()
                    return
            except Exception:
                if what == "close":
                    return

    def _relay_stderr(self) -> None:
        for raw in self._chan.makefile_stderr("rb"):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self._stderr.append(line)
            sys.stderr.write(f"[{self.node.host} agent] {line}\n")

    def lines(self) -> Iterator[str]:
        for raw in self._chan.makefile("rb"):
            yield raw.decode("utf-8", "surrogateescape")

    def ping(self) -> None:
        self._outbox.put("ping")

    def stop(self) -> None:
        self._outbox.put("eof")

    def wait(self, timeout: float) -> int | None:
        if not self._chan.status_event.wait(timeout):
            return None
        code: int = self._chan.recv_exit_status()
        return code

    def kill(self) -> None:
        self._outbox.put("close")
        # closing the socket ends a transport stuck on a dead network, and our readers
        with contextlib.suppress(Exception):
            self._transport.sock.close()

    def diagnostics(self) -> list[str]:
        return list(self._stderr)


class SSHBackend(Backend):
    """Starts agents on remote hosts over SSH (paramiko)."""

    name = "ssh"

    def __init__(self, *, ssh_port: int | None = None, remote_python: str | None = None,
                 connect_timeout: float = 10.0, config_path: Path | None = None):
        self.ssh_port = ssh_port
        self.python = remote_python or sys.executable
        self.connect_timeout = connect_timeout
        self._config_text = load_config_text(config_path)
        self._parsed: Any = None
        self._clients: dict[str, Client] = {}
        self._extra: list[Client] = []  # jump-host clients, closed last

    @classmethod
    def from_options(cls, options: LaunchOptions) -> SSHBackend:
        return cls(ssh_port=options.ssh_port, remote_python=options.remote_python,
                   connect_timeout=options.ssh_connect_timeout)

    def target(self, alias: str) -> SSHTarget:
        if self._parsed is None:
            self._parsed = parse_config(self._config_text)
        return resolve_target(alias, self._parsed, port_override=self.ssh_port)

    def prepare(self, nodes: tuple[NodePlan, ...]) -> None:
        """Connect to every host in parallel; raise one UsageError naming every failure.

        Called again before each restart: live connections are kept, dead ones replaced.
        """
        hosts = [n.host for n in nodes if not self._connected(n.host)]
        with ThreadPoolExecutor(max_workers=min(64, max(1, len(hosts)))) as pool:
            results = list(pool.map(self._try_connect, hosts))
        failures = [r for r in results if isinstance(r, HostError)]
        for host, result in zip(hosts, results, strict=True):
            if not isinstance(result, HostError):
                self._clients[host] = result
        if failures:
            raise unreachable_error(failures, len(nodes))

    def _connected(self, host: str) -> bool:
        client = self._clients.get(host)
        transport = client.get_transport() if client is not None else None
        return transport is not None and transport.is_active()

    def start(self, node: NodePlan) -> AgentHandle:
        return RemoteAgent(node, self._clients[node.host], self.python)

    def client(self, host: str) -> Client:
        """The open connection to ``host`` (after :meth:`prepare`)."""
        return self._clients[host]

    def close(self) -> None:
        for client in [*self._clients.values(), *self._extra]:
            with contextlib.suppress(Exception):
                # close the socket first: Transport.close() joins a thread that may be
                # stuck on a dead network
                client.get_transport().sock.close()
            with contextlib.suppress(Exception):
                client.close()
        self._clients.clear()
        self._extra.clear()

    # -- connecting --------------------------------------------------------------------------
    def connect(self, target: SSHTarget) -> Client:
        """An authenticated connection to ``target`` (through its jump hosts);
        :class:`HostError` says why not and how to fix it."""
        return self._connect(target, sock=None, jumps=None)

    def _try_connect(self, alias: str) -> Client | HostError:
        try:
            return self._connect(self.target(alias), sock=None, jumps=None)
        except HostError as exc:
            return exc

    def _connect(self, target: SSHTarget, sock: Any, jumps: tuple[str, ...] | None) -> Client:
        paramiko = import_paramiko()
        if jumps is None:
            jumps = target.proxy_jump
        if jumps:
            sock = self._through_jumps(target, jumps)
        client = paramiko.SSHClient()
        keys = client.get_host_keys()
        for path in target.known_hosts_files:
            with contextlib.suppress(FileNotFoundError, OSError):
                keys.load(path)
        client.set_missing_host_key_policy(_policy(target))
        self._handshake(client, target, sock)
        transport = client.get_transport()
        transport.set_keepalive(5)
        # small protocol messages (a ping, an exit event) must not wait for delayed ACKs
        with contextlib.suppress(OSError, AttributeError):
            transport.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return client

    def _handshake(self, client: Client, target: SSHTarget, sock: Any) -> None:
        """Connect and authenticate; every failure is a :class:`HostError` with its fix."""
        paramiko = import_paramiko()
        reach = f"{target.hostname}:{target.port}"
        try:
            client.connect(
                target.hostname, port=target.port, username=target.user,
                key_filename=[p for p in target.identity_files if Path(p).exists()] or None,
                timeout=self.connect_timeout, banner_timeout=self.connect_timeout,
                auth_timeout=self.connect_timeout, sock=sock,
            )
        except _UnknownHostKey:
            raise HostError(target.alias, f"the host key of {reach} is not in known_hosts",
                            f"run `ssh {target.alias}` once to check and record it "
                            "(or set StrictHostKeyChecking accept-new for it in "
                            "~/.ssh/config)") from None
        except paramiko.BadHostKeyException:
            raise HostError(target.alias, f"the host key of {reach} has CHANGED since it was "
                            "recorded", f"if the change is expected, remove the old key "
                            f"with `ssh-keygen -R {target.hostname}`") from None
        except paramiko.AuthenticationException:
            raise HostError(target.alias, f"{target.user}@{reach} refused our keys",
                            f"authorise a key with `ssh-copy-id {target.user}@{target.alias}` "
                            "or name one with IdentityFile in ~/.ssh/config") from None
        except socket.gaierror:
            raise HostError(target.alias, f"cannot resolve {target.hostname!r}",
                            "check the name in the hostfile, or give it a HostName in "
                            "~/.ssh/config") from None
        except paramiko.ssh_exception.NoValidConnectionsError:
            raise HostError(target.alias, f"connection refused by {reach}",
                            "check that sshd runs there and the port (--ssh_port, Port)"
                            ) from None
        except TimeoutError:
            raise HostError(target.alias, f"no answer from {reach} within "
                            f"{self.connect_timeout:g} s", "check that the host is up and "
                            "reachable from here") from None
        except OSError as exc:
            reason = ("unreachable" if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH)
                      else exc.strerror or str(exc))
            raise HostError(target.alias, f"{reach}: {reason}",
                            "check that the host is up and reachable from here") from None
        except paramiko.SSHException as exc:
            raise HostError(target.alias, f"ssh to {reach} failed: {exc}",
                            f"try `ssh -v {target.alias}`") from None

    def _through_jumps(self, target: SSHTarget, jumps: tuple[str, ...]) -> Any:
        """A channel to ``target`` tunnelled through the jump hosts, in order."""
        sock = None
        hops = [*jumps]
        client = None
        for i, spec in enumerate(hops):
            user, host, port = parse_jump(spec)
            hop = resolve_target(host, self._config_text, port_override=port)
            if user:
                hop = SSHTarget(**{**hop.__dict__, "user": user})
            client = self._connect(hop, sock=sock, jumps=())
            self._extra.append(client)
            if i + 1 < len(hops):
                _, nxt_host, nxt_port = parse_jump(hops[i + 1])
                nxt = resolve_target(nxt_host, self._config_text, port_override=nxt_port)
                dest = (nxt.hostname, nxt.port)
            else:
                dest = (target.hostname, target.port)
            try:
                sock = client.get_transport().open_channel("direct-tcpip", dest, ("", 0))
            except Exception as exc:
                raise HostError(target.alias, f"jump host {host} cannot reach "
                                f"{dest[0]}:{dest[1]} ({exc})",
                                "check ProxyJump in ~/.ssh/config") from None
        return sock


class _UnknownHostKey(Exception):
    pass


def _policy(target: SSHTarget) -> Any:
    """The paramiko host key policy for the target's ``StrictHostKeyChecking``."""
    policy: Any = import_paramiko().MissingHostKeyPolicy

    class Refuse(policy):
        def missing_host_key(self, client: Client, hostname: str, key: Any) -> None:
            raise _UnknownHostKey(hostname)

    class AcceptNew(policy):
        def missing_host_key(self, client: Client, hostname: str, key: Any) -> None:
            client.get_host_keys().add(hostname, key.get_name(), key)
            if target.known_hosts_files:
                path = Path(target.known_hosts_files[0])
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "a") as known:
                    known.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")

    class AcceptAny(policy):
        def missing_host_key(self, client: Client, hostname: str, key: Any) -> None:
            return None

    return {"yes": Refuse, "accept-new": AcceptNew, "no": AcceptAny}[
        target.strict_host_key_checking]()
