"""A real single-node SLURM on this machine: munged, slurmctld and slurmd from Debian's
slurm-wlm, with a config of the test's own (no cgroups: SLURM 22.05 runs here with
proctrack/linuxproc and task/none; see DESIGN.md's measured facts)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")


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


@dataclass
class SimSlurm:
    workdir: Path
    started_munge: bool = False

    @property
    def conf(self) -> Path:
        return self.workdir / "slurm.conf"

    def env(self) -> dict[str, str]:
        """The environment in which srun/sbatch talk to this SLURM."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> SimSlurm:
        for sub in ("state", "spool", "log", "run"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        if not _munge_works():
            for d in ("/run/munge", "/var/lib/munge", "/var/log/munge"):
                Path(d).mkdir(parents=True, exist_ok=True)
                shutil.chown(d, "munge", "munge")
            subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
            self.started_munge = True
            deadline = time.monotonic() + 10
            while not _munge_works():
                if time.monotonic() > deadline:
                    raise RuntimeError("munged did not come up")
                time.sleep(0.1)
        node = socket.gethostname().split(".")[0]
        w = self.workdir
        self.conf.write_text(
            f"ClusterName=dstest\nSlurmctldHost={node}\nSlurmUser=root\nSlurmdUser=root\n"
            "AuthType=auth/munge\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
            f"SlurmctldPort={_free_port()}\nSlurmdPort={_free_port()}\n"
            f"StateSaveLocation={w}/state\nSlurmdSpoolDir={w}/spool\n"
            f"SlurmctldPidFile={w}/run/slurmctld.pid\nSlurmdPidFile={w}/run/slurmd.pid\n"
            f"SlurmctldLogFile={w}/log/slurmctld.log\nSlurmdLogFile={w}/log/slurmd.log\n"
            "ReturnToService=2\nMpiDefault=none\nKillWait=5\nMinJobAge=2\n"
            f"NodeName={node} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN\n"
            f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP\n")
        env = self.env()
        subprocess.run(["/usr/sbin/slurmctld", "-f", str(self.conf)], env=env, check=True)
        subprocess.run(["/usr/sbin/slurmd", "-f", str(self.conf)], env=env, check=True)
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                 text=True, check=False).stdout.strip()
            if out in ("idle", "mix", "alloc"):
                return self
            if time.monotonic() > deadline:
                log = (w / "log" / "slurmctld.log").read_text()[-2000:]
                raise RuntimeError(f"SLURM did not come up (state {out!r}): {log}")
            time.sleep(0.2)

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env(),
                       capture_output=True, check=False)
        for name in ("slurmd", "slurmctld"):
            pidfile = self.workdir / "run" / f"{name}.pid"
            with contextlib.suppress(OSError, ValueError):
                pid = int(pidfile.read_text())
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    os.kill(pid, 0)
                    time.sleep(0.05)
        if self.started_munge:
            subprocess.run(["pkill", "-x", "munged"], check=False)
