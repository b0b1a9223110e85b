"""A real SLURM on this machine: munged, slurmctld and slurmd from Debian's slurm-wlm, with a
config of the test's own (no cgroups: SLURM 22.05 runs here with proctrack/linuxproc and
task/none; see DESIGN.md's measured facts).

:class:`SimSlurm` is one node, this machine. :class:`SimSlurmCluster` is one node per host
of a :class:`~tests.cluster.simcluster.SimCluster`: slurmctld in the root namespace (on the
bridge's address), one slurmd inside each host, started the way its sshd is, so that
``SimCluster.kill_host`` kills the host's slurmd and job steps with it.
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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.cluster.simcluster import SimCluster, SimHost

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
MUNGE_PIDFILE = Path("/run/munge/munged.pid")
UP_STATES = ("idle", "mix", "alloc")
# `ip netns exec` mounts a fresh /sys (the namespace's own), which has nothing on
# /sys/fs/cgroup, and slurmd 22.05 refuses to start without a cgroup file system there
# ("No filesystem mounted on /sys/fs/cgroup") even with proctrack/linuxproc: a tmpfs, in
# the mount namespace of the host's slurmd only, is what it takes
CGROUP_MOUNT = ("mount -t tmpfs slurm-cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd && "
                "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd")


def missing_tools() -> list[str]:
    missing = [d for d in DAEMONS if not os.access(d, os.X_OK)]
    missing += [t for t in ("srun", "sbatch", "scontrol", "munge") if not shutil.which(t)]
    if os.geteuid() != 0:
        missing.append("root")
    return missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _munge_works() -> bool:
    munge = subprocess.run(["munge", "-n"], capture_output=True, check=False)
    if munge.returncode != 0:
        return False
    return subprocess.run(["unmunge"], input=munge.stdout, capture_output=True,
                          check=False).returncode == 0


def ensure_munge() -> int | None:
    """Start munged unless one already answers; the pid of the one started here, if any."""
    if _munge_works():
        return None
    for d in ("/run/munge", "/var/lib/munge", "/var/log/munge"):
        Path(d).mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
    deadline = time.monotonic() + 10
    while not _munge_works():
        if time.monotonic() > deadline:
            raise RuntimeError("munged did not come up")
        time.sleep(0.1)
    return int(MUNGE_PIDFILE.read_text())


def _terminate(pid: int, timeout: float = 5) -> None:
    """SIGTERM ``pid`` and wait (up to ``timeout``) for it to be gone."""
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGTERM)
        for _ in range(int(timeout / 0.05)):
            os.kill(pid, 0)
            time.sleep(0.05)


def _conf_head(workdir: Path, ctld: str, slurmd_port: int) -> str:
    """The slurm.conf lines every simulated SLURM shares; ``ctld`` is SlurmctldHost's value."""
    w = workdir
    return (
        f"ClusterName=dstest\nSlurmctldHost={ctld}\nSlurmUser=root\nSlurmdUser=root\n"
        "AuthType=auth/munge\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
        "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
        f"SlurmctldPort={_free_port()}\nSlurmdPort={slurmd_port}\n"
        f"StateSaveLocation={w}/state\nSlurmctldPidFile={w}/run/slurmctld.pid\n"
        f"SlurmctldLogFile={w}/log/slurmctld.log\n"
        "ReturnToService=2\nMpiDefault=none\nKillWait=5\nMinJobAge=2\n")


@dataclass
class _Slurm:
    """What both simulated SLURMs share: the work directory, munge, slurmctld, teardown."""

    workdir: Path
    munge_pid: int | None = None
    slurmd_port: int = field(default_factory=_free_port)

    @property
    def conf(self) -> Path:
        return self.workdir / "slurm.conf"

    def env(self) -> dict[str, str]:
        """The environment in which srun/sbatch talk to this SLURM."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _start_controller(self, conf: str) -> None:
        """Directories, munge, the config, and slurmctld (it daemonizes)."""
        for sub in ("state", "spool", "log", "run"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self.munge_pid = ensure_munge()
        self.conf.write_text(conf)
        subprocess.run(["/usr/sbin/slurmctld", "-f", str(self.conf)], env=self.env(),
                       check=True)

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo shows it (``idle``, ``alloc``, ``idle*``, ...)."""
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env(),
                             capture_output=True, text=True, check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def _wait_up(self, nodes: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if len(states) == nodes and all(s in UP_STATES for s in states.values()):
                return
            if time.monotonic() > deadline:
                log = (self.workdir / "log" / "slurmctld.log").read_text()[-2000:]
                raise RuntimeError(f"SLURM did not come up (states {states}): {log}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel every job, stop the slurmd(s), slurmctld and the munged started here."""
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env(),
                       capture_output=True, check=False)
        self._stop_slurmds()
        with contextlib.suppress(OSError, ValueError):
            _terminate(int((self.workdir / "run" / "slurmctld.pid").read_text()))
        if self.munge_pid is not None:
            _terminate(self.munge_pid)
            self.munge_pid = None

    def _stop_slurmds(self) -> None:
        raise NotImplementedError


@dataclass
class SimSlurm(_Slurm):
    """One node, this machine: slurmctld and slurmd side by side."""

    def start(self) -> SimSlurm:
        node = socket.gethostname().split(".")[0]
        w = self.workdir
        self._start_controller(
            _conf_head(w, node, self.slurmd_port)
            + f"SlurmdSpoolDir={w}/spool\nSlurmdPidFile={w}/run/slurmd.pid\n"
            f"SlurmdLogFile={w}/log/slurmd.log\n"
            f"NodeName={node} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN\n"
            f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP\n")
        subprocess.run(["/usr/sbin/slurmd", "-f", str(self.conf)], env=self.env(), check=True)
        self._wait_up(1)
        return self

    def _stop_slurmds(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            _terminate(int((self.workdir / "run" / "slurmd.pid").read_text()))


@dataclass
class SimSlurmCluster(_Slurm):
    """One SLURM node (CPUs=1) per host of a started ``cluster``; slurmctld listens on the
    bridge address, which every host reaches on its own subnet, and srun's connections
    come from it too: the hosts need no route and no name for this machine.

    SlurmdTimeout is long, so a killed host's node is never set DOWN during a test: the
    controller does not notice, as on a real cluster in the first minutes of a node loss.
    """

    cluster: SimCluster = field(kw_only=True)
    slurmds: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        # named for the cluster's prefix, so that cleanup_stale knows an earlier run's
        return self.workdir / f"slurm-{self.cluster.prefix}.conf"

    @property
    def gateway(self) -> str:
        return f"198.18.{self.cluster.subnet}.1"

    def start(self) -> SimSlurmCluster:
        assert self.cluster.hosts, "start the SimCluster first"
        self.cleanup_stale()
        hosts = self.cluster.hosts
        w = self.workdir
        me = socket.gethostname().split(".")[0]
        self._start_controller(
            _conf_head(w, f"{me}({self.gateway})", self.slurmd_port)
            + f"SlurmdSpoolDir={w}/spool/%n\nSlurmdPidFile={w}/run/slurmd-%n.pid\n"
            f"SlurmdLogFile={w}/log/slurmd-%n.log\nSlurmdTimeout=300\n"
            + "".join(f"NodeName={h.name} NodeAddr={h.address} CPUs=1 RealMemory=1000 "
                      "State=UNKNOWN\n" for h in hosts)
            + f"PartitionName=debug Nodes={','.join(h.name for h in hosts)} Default=YES "
            "MaxTime=INFINITE State=UP\n")
        for host in hosts:
            self.start_slurmd(host)
        self._wait_up(len(hosts))
        return self

    def start_slurmd(self, host: SimHost) -> None:
        """Start ``host``'s slurmd inside it (its network and UTS namespace), in the
        foreground, so its pid is the Popen's; also: the host is back after a kill."""
        (self.workdir / "spool" / host.name).mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "log" / f"slurmd-{host.name}.out", "ab")  # noqa: SIM115
        self.slurmds[host.name] = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c",
             f'hostname "$0" && {CGROUP_MOUNT} && exec /usr/sbin/slurmd -D -N "$0" -f "$1"',
             host.name, str(self.conf)],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=self.env())
        log.close()
        self._wait_listening(host)

    def _wait_listening(self, host: SimHost, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with socket.socket() as sock:
                sock.settimeout(1)
                if sock.connect_ex((host.address, self.slurmd_port)) == 0:
                    return
            proc = self.slurmds[host.name]
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / "log" / f"slurmd-{host.name}.log")
                text = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"slurmd on {host.name} not listening "
                                   f"(exit {proc.poll()}): {text}")
            time.sleep(0.05)

    def cleanup_stale(self) -> None:
        """Stop the slurmctld an interrupted earlier run with this prefix left behind (its
        slurmds died with their namespaces: SimCluster.cleanup_stale)."""
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if argv[0] == b"/usr/sbin/slurmctld" and \
                        Path(os.fsdecode(argv[-2])).name == self.conf.name:
                    _terminate(int(entry.name))

    def jobs(self) -> list[str]:
        """The ids of the jobs SLURM still holds (pending, running or completing)."""
        return subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env(),
                              capture_output=True, text=True, check=False).stdout.split()

    def wait_no_jobs(self, timeout: float = 15) -> list[str]:
        """Wait for every allocation to be released; the ids of those left."""
        deadline = time.monotonic() + timeout
        while (left := self.jobs()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def wait_no_strays(self, timeout: float = 10) -> dict[str, list[int]]:
        """The hosts' processes besides their sshd and slurmd (a job's leftovers), once
        none is left or ``timeout`` has passed."""
        slurmds = frozenset(p.pid for p in self.slurmds.values() if p.poll() is None)
        return self.cluster.wait_no_strays(timeout, daemons=slurmds)

    def _stop_slurmds(self) -> None:
        for proc in self.slurmds.values():
            if proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
