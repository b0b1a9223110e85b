"""Resources: the hosts a job may use and their slot ids, in the order the user gave them.

A slot is a GPU index on a GPU host, or a CPU worker position on a CPU-only host. Resources
come from a hostfile (:mod:`.hostfile`) or from probing this machine (:func:`probe_local`);
:mod:`.placement` narrows them with ``--include``/``--exclude``/``--num_nodes``/``--num_gpus``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from deepshard.errors import UsageError

LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class Host:
    """One host and its slot ids (ascending, unique). ``where`` says where it was defined."""

    name: str
    slots: tuple[int, ...]
    where: str = ""


@dataclass(frozen=True)
class Resources:
    """Hosts in order, each with its slots. ``origin`` names the source for error messages."""

    hosts: tuple[Host, ...]
    origin: str

    def names(self) -> tuple[str, ...]:
        return tuple(h.name for h in self.hosts)

    def get(self, name: str) -> Host | None:
        return next((h for h in self.hosts if h.name == name), None)

    def as_dict(self) -> dict[str, list[int]]:
        return {h.name: list(h.slots) for h in self.hosts}


def gpu_ids(environ: Mapping[str, str], proc_root: Path = Path("/proc")) -> tuple[int, ...]:
    """The GPU ids visible to this process, without importing torch.

    ``CUDA_VISIBLE_DEVICES`` (integer ids) wins when set; otherwise the NVIDIA driver's
    ``/proc/driver/nvidia/gpus`` entries are counted. Raises on a malformed variable, since
    guessing would place workers on the wrong devices.
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if not all(v.isdigit() for v in ids):
            raise UsageError(
                f"CUDA_VISIBLE_DEVICES={visible!r} is not a list of integer GPU ids",
                where="environment",
                hint="set it to e.g. 0,1 or unset it (UUIDs are not supported for placement)",
            )
        return tuple(int(v) for v in ids)
    gpus = proc_root / "driver" / "nvidia" / "gpus"
    try:
        return tuple(range(len(list(gpus.iterdir()))))
    except OSError:
        return ()


def probe_local(num_gpus: int | None, environ: Mapping[str, str]) -> Resources:
    """This machine as the only host: its GPUs, or ``num_gpus`` CPU slots (default 1)."""
    gpus = gpu_ids(environ)
    if gpus:
        if num_gpus is not None:
            if num_gpus > len(gpus):
                raise UsageError(
                    f"asked for {num_gpus} GPUs but this machine has {len(gpus)} "
                    f"({','.join(map(str, gpus))})",
                    where="--num_gpus",
                    hint=f"use --num_gpus {len(gpus)} or fewer",
                )
            gpus = gpus[:num_gpus]
        return Resources((Host("localhost", gpus, "this machine"),), "this machine (GPUs)")
    count = 1 if num_gpus is None else num_gpus
    return Resources(
        (Host("localhost", tuple(range(count)), "this machine"),), "this machine (CPU slots)"
    )


def local_names(extra: Iterable[str] = ()) -> frozenset[str]:
    """Names and addresses by which this machine refers to itself (no DNS queries)."""
    names = set(LOCAL_NAMES)
    hostname = socket.gethostname()
    names.update({hostname, hostname.split(".")[0]})
    names.update(extra)
    return frozenset(names)


def interface_addresses() -> frozenset[str]:
    """The IP addresses of this machine's network interfaces."""
    import psutil  # ~40 ms to import: only needed when a hostfile is used

    return frozenset(
        a.address.split("%")[0]
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    )


def is_local(name: str, names: frozenset[str]) -> bool:
    """Whether ``name`` is this machine: a known local name or any loopback address."""
    if name in names:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def cpu_count() -> int:
    """Cores this process may run on (affinity and cpusets respected)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
