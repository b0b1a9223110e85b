"""``ds_report --hostfile F``: check every host before a job, over ds-run's own transport.

Each host runs a small probe with the same Python ds-run would use; its answers are
compared with this machine's. One :class:`HostCheck` per host, with a verdict and the fix.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from deepshard.launcher.resources import Resources, interface_addresses, is_local, local_names

MAX_SKEW = 1.0
"""Seconds of clock difference beyond which a host fails (logs and timeouts disagree)."""

PROBE = r"""
import json, os, socket, sys, time
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except Exception:
        return None
cwd, port = sys.argv[1], int(sys.argv[2])
try:
    gpus = len(os.listdir("/proc/driver/nvidia/gpus"))
except OSError:
    gpus = 0
free = None
if port:
    with socket.socket() as s:
        try:
            s.bind(("", port))
            free = True
        except OSError:
            free = False
print(json.dumps({"python": sys.version.split()[0], "deepshard": version("deepshard"),
                  "torch": version("torch"), "cwd": os.path.isdir(cwd), "gpus": gpus,
                  "time": time.time(), "port_free": free}))
"""


@dataclass(frozen=True)
class HostCheck:
    """The verdict on one host; ``problems`` and ``fixes`` are empty when it is ok."""

    host: str
    reachable: bool
    facts: dict[str, object] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.reachable and not self.problems


def expected_versions() -> dict[str, str | None]:
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"python": sys.version.split()[0], "deepshard": version("deepshard"),
            "torch": version("torch")}


def judge(host: str, facts: dict, slots: int, expected: dict[str, str | None],
          skew: float, check_port: int) -> HostCheck:
    """Compare one host's probe answers with this machine's (pure)."""
    problems, fixes = [], []
    for key in ("python", "deepshard", "torch"):
        if facts.get(key) != expected[key]:
            problems.append(f"{key} {facts.get(key) or 'missing'} (here {expected[key]})")
            fixes.append(f"install the same {key} there (same venv path), or --remote_python")
    if not facts.get("cwd"):
        problems.append("working directory missing")
        fixes.append("share the working directory (same path) with every host")
    gpus = int(facts.get("gpus") or 0)
    if gpus and gpus < slots:
        problems.append(f"{gpus} GPU(s) for {slots} slots")
        fixes.append(f"set slots={gpus} for {host} in the hostfile")
    if abs(skew) > MAX_SKEW:
        problems.append(f"clock {skew:+.1f} s off")
        fixes.append("run NTP (chrony/systemd-timesyncd) on every host")
    if check_port and facts.get("port_free") is False:
        problems.append(f"master port {check_port} in use")
        fixes.append("pass another --master_port")
    return HostCheck(host, True, {**facts, "skew": round(skew, 3)}, problems, fixes)


def _probe_command(python: str, cwd: str, port: int) -> list[str]:
    return [python, "-c", PROBE, cwd, str(port)]


def _run_local(python: str, cwd: str, port: int) -> tuple[str, str, int]:
    proc = subprocess.run(_probe_command(python, cwd, port), capture_output=True, text=True,
                          timeout=60, check=False)
    return proc.stdout, proc.stderr, proc.returncode


def _run_remote(client: Any, python: str, cwd: str, port: int,
                timeout: float) -> tuple[str, str, int]:
    _, stdout, stderr = client.exec_command(shlex.join(_probe_command(python, cwd, port)),
                                            timeout=timeout)
    out, err = stdout.read().decode(), stderr.read().decode()
    return out, err, stdout.channel.recv_exit_status()


def preflight(resources: Resources, *, cwd: str, master_port: int, ssh_port: int | None,
              remote_python: str | None, timeout: float) -> list[HostCheck]:
    """Probe every host in parallel; the first host also checks the master port."""
    from deepshard.launcher.backends.ssh import HostError, SSHBackend

    names = local_names(interface_addresses())
    expected = expected_versions()
    backend = SSHBackend(ssh_port=ssh_port, remote_python=remote_python,
                         connect_timeout=timeout)
    python = remote_python or sys.executable

    def check(index: int) -> HostCheck:
        try:
            return probe(index)
        except Exception as exc:  # one odd host must give one FAIL row, not a traceback
            return HostCheck(resources.hosts[index].name, True,
                             problems=[f"probe failed: {type(exc).__name__}: {exc}"],
                             fixes=["run the probe by hand: ssh <host> python -c ..."])

    def probe(index: int) -> HostCheck:
        host = resources.hosts[index]
        port = master_port if index == 0 else 0
        start = time.time()
        if is_local(host.name, names):
            out, err, code = _run_local(sys.executable, cwd, port)
        else:
            client = backend._try_connect(host.name)
            if isinstance(client, HostError):
                return HostCheck(host.name, False, problems=[client.reason],
                                 fixes=[client.hint])
            try:
                out, err, code = _run_remote(client, python, cwd, port, timeout * 3)
            finally:
                client.close()
        end = time.time()
        if code != 0 or not out.strip():
            why = (err.strip().splitlines() or [f"exit {code}"])[-1]
            return HostCheck(host.name, True, problems=[f"probe failed: {why}"],
                             fixes=[f"check that {python} exists there (or --remote_python)"])
        facts = json.loads(out.strip().splitlines()[-1])
        skew = float(facts.pop("time")) - (start + end) / 2
        return judge(host.name, facts, len(host.slots), expected, skew, port)

    with ThreadPoolExecutor(max_workers=min(64, len(resources.hosts))) as pool:
        return list(pool.map(check, range(len(resources.hosts))))
