"""Resources from a SLURM allocation: ds-run inside ``sbatch``/``salloc`` needs no hostfile.

Hosts come from ``SLURM_JOB_NODELIST`` (``scontrol show hostnames`` when available, else
the pure expander of :mod:`deepshard.hostlist`); each host's slots are the GPU ids SLURM
gave the job (``SLURM_JOB_GPUS``, else ``SLURM_GPUS_ON_NODE`` as a count), or, without
GPUs, ``--num_gpus`` CPU slots.
"""

from __future__ import annotations

from collections.abc import Mapping

from deepshard.errors import UsageError
from deepshard.hostlist import expand_hostlist
from deepshard.launcher.resources import Host, Resources


def in_allocation(environ: Mapping[str, str]) -> bool:
    """Whether this process runs inside a SLURM job with a node list."""
    return bool(environ.get("SLURM_JOB_ID")) and bool(
        environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST"))


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a node list: SLURM's own expansion when scontrol is here."""
    import shutil
    import subprocess

    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], text=True,
                                 capture_output=True, timeout=30, check=True).stdout
            hosts = out.split()
            if hosts:
                return hosts
        except (OSError, subprocess.SubprocessError):
            pass  # the pure expander below gives the same answer for valid lists
    return expand_hostlist(nodelist)


def gpu_slots(environ: Mapping[str, str]) -> tuple[int, ...]:
    """The GPU ids SLURM gave the job on each node (empty: no GPUs)."""
    ids = environ.get("SLURM_JOB_GPUS") or environ.get("SLURM_STEP_GPUS") or ""
    if ids.strip():
        items = [i.strip() for i in ids.split(",") if i.strip()]
        if not all(i.isdigit() for i in items):
            raise UsageError(f"SLURM_JOB_GPUS={ids!r} is not a list of GPU ids",
                             where="environment", hint="request GPUs with --gpus-per-node")
        return tuple(int(i) for i in items)
    count = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if count.isdigit():
        return tuple(range(int(count)))
    return ()


def allocation_resources(environ: Mapping[str, str], hosts: list[str],
                         num_gpus: int | None) -> Resources:
    """The allocation's hosts, each with the job's GPUs or ``num_gpus`` CPU slots."""
    job = environ.get("SLURM_JOB_ID", "?")
    if not hosts:
        raise UsageError("the allocation names no node", where=f"SLURM job {job}",
                         hint="run ds-run inside sbatch or salloc")
    gpus = gpu_slots(environ)
    if gpus and num_gpus is not None:
        if num_gpus > len(gpus):
            raise UsageError(f"asked for {num_gpus} GPUs per node but the job has "
                             f"{len(gpus)} ({','.join(map(str, gpus))})", where="--num_gpus",
                             hint="request more with sbatch --gpus-per-node, or ask for fewer")
        gpus = gpus[:num_gpus]
    slots = gpus or tuple(range(1 if num_gpus is None else num_gpus))
    return Resources(tuple(Host(h, slots, f"SLURM job {job}") for h in hosts),
                     f"SLURM job {job}")
