"""Backends start one agent per node; the coordinator only sees :class:`AgentHandle`s.

``local`` runs the agents of nodes that are this machine; the others are started by the
backend ``ds-run --launcher NAME`` names. :data:`BACKENDS` is the one list of them: it
feeds the ``--launcher`` choice and its help, the default (:func:`default_backend`), and
:func:`get_backend`, which imports a backend's module only when a job needs it (the ssh
backend brings paramiko, ~200 ms).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from deepshard.launcher.backends.base import AgentHandle, Backend, Router
from deepshard.launcher.backends.local import LocalBackend
from deepshard.launcher.slurm_env import in_allocation
from deepshard.launcher.spawn import DEFAULT_HOSTFILE


@dataclass(frozen=True)
class BackendSpec:
    """What ds-run knows of a backend before importing it."""

    target: str
    """``module:Class`` of the :class:`Backend` subclass."""
    summary: str
    """How it starts agents, for ``ds-run --help``."""
    remote: bool = True
    """Whether it reaches hosts that are not this machine (``local`` refuses them)."""
    takes_launcher_args: bool = False
    """Whether ``--launcher_args`` means anything to it."""
    detect: Callable[[Mapping[str, str]], bool] | None = None
    """Whether the environment asks for it when no hostfile names the hosts."""
    detect_summary: str = ""
    """When :attr:`detect` holds, for ``ds-run --help``."""


BACKENDS: dict[str, BackendSpec] = {
    "ssh": BackendSpec("deepshard.launcher.backends.tree:TreeBackend",
                       "paramiko, no external binary; above 64 hosts through a tree of relays, "
                       "see --fanout"),
    "pdsh": BackendSpec("deepshard.launcher.backends.pdsh:PdshBackend", "as DeepSpeed does",
                        takes_launcher_args=True),
    "slurm": BackendSpec("deepshard.launcher.backends.slurm:SlurmBackend",
                         "srun inside an allocation", takes_launcher_args=True,
                         detect=in_allocation, detect_summary="inside a SLURM allocation"),
    "openmpi": BackendSpec("deepshard.launcher.backends.mpi:OpenmpiBackend",
                           "Open MPI's mpirun, one process per slot, as DeepSpeed",
                           takes_launcher_args=True),
    "mpich": BackendSpec("deepshard.launcher.backends.mpi:MpichBackend",
                         "MPICH's mpirun, as DeepSpeed", takes_launcher_args=True),
    "impi": BackendSpec("deepshard.launcher.backends.mpi:ImpiBackend",
                        "Intel MPI's mpirun, as DeepSpeed", takes_launcher_args=True),
    "mvapich": BackendSpec("deepshard.launcher.backends.mpi:MvapichBackend",
                           "MVAPICH's mpirun, as DeepSpeed", takes_launcher_args=True),
    "local": BackendSpec("deepshard.launcher.backends.local:LocalBackend",
                         "refuse remote hosts", remote=False),
}
"""Every backend ``--launcher`` accepts, by name, in the order ``--help`` lists them."""
DEFAULT_BACKEND = "ssh"
"""The backend for remote hosts when nothing asks for another."""


def get_backend(name: str) -> type[Backend]:
    """The backend class registered as ``name`` (its module imported now)."""
    try:
        spec = BACKENDS[name]
    except KeyError:
        raise KeyError(f"no backend {name!r} (known: {', '.join(BACKENDS)})") from None
    module, _, attr = spec.target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"{spec.target} is not a Backend")
    return cls


def default_backend(hostfile: str | None, environ: Mapping[str, str]) -> str:
    """The first backend whose environment is detected (slurm inside an allocation) when no
    hostfile is given or found at the default path; else :data:`DEFAULT_BACKEND`."""
    if hostfile is None and not os.path.isfile(DEFAULT_HOSTFILE):
        for name, spec in BACKENDS.items():
            if spec.detect is not None and spec.detect(environ):
                return name
    return DEFAULT_BACKEND


def launcher_help() -> str:
    """The help of ``ds-run --launcher``, from the registry."""
    kinds = "; ".join(f"{name}: {spec.summary}" for name, spec in BACKENDS.items())
    detected = "".join(f"{name} {spec.detect_summary} without --hostfile, else "
                       for name, spec in BACKENDS.items() if spec.detect is not None)
    return (f"How agents start on hosts that are not this machine ({kinds}) "
            f"[default: {detected}{DEFAULT_BACKEND}].")


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "AgentHandle", "Backend", "BackendSpec",
           "LocalBackend", "Router", "default_backend", "get_backend", "launcher_help"]
