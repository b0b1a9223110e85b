"""A cluster of real hosts on one machine: network namespaces, each running its own sshd.

Each host is a network namespace joined to a bridge in the root namespace, with its own
address (RFC 2544's benchmarking range, 198.18.0.0/15, which nothing real uses), its own
UTS namespace and hostname, and an ``/etc/hosts`` (``/etc/netns/<ns>/hosts``, which
``ip netns exec`` mounts over ``/etc/hosts``) in which every host's name resolves to its
address: gloo picks its interface from the hostname, so this is what makes cross-host
process groups work. The test client gets a home directory with a key, a known_hosts file
and an ``~/.ssh/config`` that names every host.

Everything is torn down by :meth:`SimCluster.stop`, including every process that runs in
a host's namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, text=True, capture_output=True)


def missing_tools() -> list[str]:
    """What this machine lacks to build a cluster (empty when all is there)."""
    needed = {"ip": shutil.which("ip"), "unshare": shutil.which("unshare"),
              "ssh-keygen": shutil.which("ssh-keygen"), "sshd": SSHD if os.access(SSHD, os.X_OK)
              else None}
    missing = [name for name, path in needed.items() if not path]
    if os.geteuid() != 0:
        missing.append("root")
    return missing


@dataclass
class SimHost:
    name: str
    address: str
    netns: str
    sshd: subprocess.Popen | None = None

    def pids(self) -> list[int]:
        """Every process running in this host's network namespace."""
        out = run("ip", "netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def exec(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a command inside the host (its network namespace and /etc/hosts)."""
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], text=True,
                              capture_output=True, timeout=timeout, check=False)


@dataclass
class SimCluster:
    """``count`` hosts named ``<prefix>1..N``; start with :meth:`start`, end with :meth:`stop`."""

    count: int
    workdir: Path
    prefix: str = "dsh"
    subnet: int = 7  # hosts get 198.18.<subnet>.11, .12, ...
    hosts: list[SimHost] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def home(self) -> Path:
        """A HOME for ds-run with .ssh/{config,id_ed25519,known_hosts} for every host."""
        return self.workdir / "home"

    def address(self, index: int) -> str:
        return f"198.18.{self.subnet}.{10 + index}"

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> SimCluster:
        self.cleanup_stale()
        shutil.rmtree(self.workdir, ignore_errors=True)  # keys, known_hosts: all fresh
        self.workdir.mkdir(parents=True)
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"198.18.{self.subnet}.1/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        self.hosts = [SimHost(f"{self.prefix}{i}", self.address(i), f"{self.prefix}{i}")
                      for i in range(1, self.count + 1)]
        client_key = self._client_files()
        for host in self.hosts:
            self._add_host(host, client_key)
        self._wait_for_sshd()
        return self

    def stop(self) -> None:
        for host in self.hosts:
            self._kill_namespace(host)
            run("ip", "netns", "del", host.netns, check=False)
            run("ip", "link", "del", f"{host.netns}h", check=False)
            shutil.rmtree(f"/etc/netns/{host.netns}", ignore_errors=True)
            if host.sshd is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.sshd.wait(timeout=5)
        run("ip", "link", "del", self.bridge, check=False)

    def cleanup_stale(self) -> None:
        """Remove what an interrupted earlier run with the same prefix left behind."""
        for line in run("ip", "netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(self.prefix) and name[len(self.prefix):].isdigit():
                self._kill_namespace(SimHost(name, "", name))
                run("ip", "netns", "del", name, check=False)
                run("ip", "link", "del", f"{name}h", check=False)
                shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        run("ip", "link", "del", self.bridge, check=False)

    def _kill_namespace(self, host: SimHost) -> None:
        for pid in host.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # -- pieces ------------------------------------------------------------------------------
    def _client_files(self) -> Path:
        ssh = self.home / ".ssh"
        ssh.mkdir(parents=True, exist_ok=True)
        key = ssh / "cluster_key"  # not a default name: only IdentityFile offers it
        if not key.exists():
            run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
        (self.workdir / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
        return key

    def _add_host(self, host: SimHost, client_key: Path) -> None:
        veth = f"{host.netns}h"
        run("ip", "netns", "add", host.netns)
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns",
            host.netns)
        run("ip", "link", "set", veth, "master", self.bridge, "up")
        run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        run("ip", "-n", host.netns, "link", "set", "eth0", "up")
        run("ip", "-n", host.netns, "link", "set", "lo", "up")
        etc = Path(f"/etc/netns/{host.netns}")
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{h.address} {h.name}\n" for h in self.hosts))
        # a host of its own has its own /etc, and root there its own home and shell: the
        # build machine's root runs `pyenv init` from ~/.bashrc (~100 ms of CPU) in every
        # ssh session, which no cluster node does
        home = self.workdir / host.name / "root"
        home.mkdir(parents=True)
        (etc / "passwd").write_text("".join(
            f"root:x:0:0:root:{home}:/bin/sh\n" if line.startswith("root:") else line + "\n"
            for line in Path("/etc/passwd").read_text().splitlines()))
        hostdir = self.workdir / host.name
        host_key = hostdir / "ssh_host_ed25519_key"
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key))
        config = hostdir / "sshd_config"
        config.write_text(
            f"ListenAddress {host.address}\nPort 22\nHostKey {host_key}\n"
            f"AuthorizedKeysFile {self.workdir / 'authorized_keys'}\nPidFile none\n"
            "StrictModes no\nUsePAM no\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "MaxStartups 100:30:200\nMaxSessions 100\nLogLevel ERROR\n"
            # drop a dead client within seconds, as production sshd configs do
            "ClientAliveInterval 1\nClientAliveCountMax 3\n")
        self._start_sshd(host)
        pub = host_key.with_suffix(".pub").read_text().split()
        with open(self.home / ".ssh" / "known_hosts", "a") as known:
            known.write(f"{host.address} {pub[0]} {pub[1]}\n")
        with open(self.home / ".ssh" / "config", "a") as cfg:
            cfg.write(f"Host {host.name}\n    HostName {host.address}\n    User root\n"
                      f"    IdentityFile {client_key}\n")

    def _start_sshd(self, host: SimHost) -> None:
        hostdir = self.workdir / host.name
        log = open(hostdir / "sshd.log", "ab")  # noqa: SIM115  (kept by the process)
        host.sshd = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c",
             f'hostname "$0" && exec {SSHD} -D -e -f "$1"', host.name,
             str(hostdir / "sshd_config")],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()

    def kill_host(self, host: SimHost) -> None:
        """Every process of the host dies at once (SIGKILL), its sshd too: a node lost."""
        self._kill_namespace(host)
        if host.sshd is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                host.sshd.wait(timeout=5)
            host.sshd = None

    def restart_sshd(self, host: SimHost) -> None:
        """The host is back: its sshd listens again (same keys and config)."""
        self._start_sshd(host)
        self._wait_for_sshd()

    def _wait_for_sshd(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        for host in self.hosts:
            while True:
                with socket.socket() as sock:
                    sock.settimeout(1)
                    if sock.connect_ex((host.address, 22)) == 0:
                        break
                if host.sshd is not None and host.sshd.poll() is not None:
                    log = (self.workdir / host.name / "sshd.log").read_text()
                    raise RuntimeError(f"sshd on {host.name} exited: {log}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {host.name} not listening")
                time.sleep(0.05)

    def add_alias(self, alias: str, host: SimHost, **options: str) -> None:
        """Another ``Host`` block in the client's ssh config, reaching ``host`` with
        different options (e.g. IdentityFile, UserKnownHostsFile, ProxyJump)."""
        lines = {"HostName": host.address, "User": "root",
                 "IdentityFile": str(self.home / ".ssh" / "cluster_key"), **options}
        with open(self.home / ".ssh" / "config", "a") as cfg:
            cfg.write(f"Host {alias}\n" + "".join(f"    {k} {v}\n" for k, v in lines.items()))

    def stray_pids(self, daemons: frozenset[int] = frozenset()) -> dict[str, list[int]]:
        """Processes in each host other than its sshd listener and ``daemons`` (pids of
        other per-host services, e.g. a slurmd): a finished job leaves none."""
        stray = {}
        for host in self.hosts:
            pids = [p for p in host.pids() if p not in daemons
                    and (host.sshd is None or p != host.sshd.pid)]
            if pids:
                stray[host.name] = pids
        return stray

    def wait_no_strays(self, timeout: float = 10, daemons: frozenset[int] = frozenset()
                       ) -> dict[str, list[int]]:
        deadline = time.monotonic() + timeout
        while (stray := self.stray_pids(daemons)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return stray

    def hostfile(self, slots: int | list[int] = 1, names: list[str] | None = None) -> Path:
        """Write a hostfile naming ``names`` (default every host) with ``slots`` each."""
        chosen = names or [h.name for h in self.hosts]
        counts = slots if isinstance(slots, list) else [slots] * len(chosen)
        path = self.workdir / "hostfile"
        path.write_text("".join(f"{name} slots={n}\n" for name, n in
                                zip(chosen, counts, strict=True)))
        return path
