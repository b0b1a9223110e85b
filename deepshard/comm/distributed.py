"""``init_distributed()``: join the job's process group from whatever started this process.

:func:`resolve_dist_env` reads, in order of precedence, the deepshard/torchrun contract
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), SLURM's variables (a script started by
``srun`` one task per GPU) and MPI's (``mpirun`` of Open MPI, MPICH, Intel MPI or
MVAPICH, as ``ds-run --launcher openmpi|mpich|impi|mvapich`` starts the script:
:data:`MPI_RANK` and its siblings name the variables read); with none of them, the process
is a world of one. :func:`init_distributed` then initialises ``torch.distributed`` with nccl on
CUDA and gloo otherwise, and does nothing when it is already initialised.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from deepshard.comm import teardown
from deepshard.errors import UsageError, install_exit_hooks
from deepshard.hostlist import expand_hostlist
from deepshard.liveness import register_stack_dump

DEFAULT_PORT = 29500
logger = logging.getLogger(__name__)

# Each MPI's names for a process's place, first match wins: Open MPI (OMPI_COMM_WORLD_*, and
# PMIX_RANK from Open MPI 5), MPICH/Intel MPI/MVAPICH's hydra (PMI_*, MPI_LOCAL*), MVAPICH2's
# mpirun_rsh (MV2_COMM_WORLD_*), Cray PALS; WORLD_SIZE and LOCAL_SIZE are what DeepSpeed's
# MPICH and Intel MPI command lines add with -genv (they carry no rank variable).
MPI_RANK = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK",
            "PALS_RANKID")
MPI_SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "WORLD_SIZE")
MPI_LOCAL_RANK = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                  "PALS_LOCAL_RANKID")
MPI_LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE",
                  "PALS_LOCAL_SIZE", "LOCAL_SIZE")
MPI_VARIABLES = frozenset((*MPI_RANK, *MPI_SIZE, *MPI_LOCAL_RANK, *MPI_LOCAL_SIZE)
                          ) - {"WORLD_SIZE", "LOCAL_SIZE"}
"""What ``init_distributed(auto_mpi_discovery=False)`` ignores."""


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, and how to reach the rendezvous."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str
    """Which launcher's variables were read: ``contract``, ``slurm``, ``mpi`` or ``single``."""


def _int(environ: Mapping[str, str], key: str) -> int:
    value = environ[key]
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{key}={value!r} is not an integer", where="environment",
                         hint=f"unset {key} or set it to an integer") from None


def resolve_dist_env(environ: Mapping[str, str], default_port: int = DEFAULT_PORT) -> DistEnv:
    """Work out rank, world and rendezvous from the environment (pure).

    ``default_port`` is the rendezvous port when ``MASTER_PORT`` is unset (under SLURM, a
    port derived from the job id, so that jobs sharing a node differ).
    """
    return _checked(_resolve(environ, default_port))


def _checked(env: DistEnv) -> DistEnv:
    """Reject values torch would only fail on later, or hang on (a rank no one will be)."""
    def bad(what: str, hint: str) -> UsageError:
        return UsageError(what, where=f"environment (read as {env.source})", hint=hint)

    if env.world_size < 1:
        raise bad(f"world size {env.world_size} is not positive", "set WORLD_SIZE >= 1")
    if not 0 <= env.rank < env.world_size:
        raise bad(f"rank {env.rank} is outside the world of {env.world_size}",
                  f"set RANK to 0..{env.world_size - 1}")
    if not 1 <= env.master_port <= 65535:
        raise bad(f"MASTER_PORT {env.master_port} is not a TCP port", "use 1..65535")
    if not env.master_addr:
        raise bad("MASTER_ADDR is empty", "set it to the first host's address, or unset it")
    return env


def _resolve(environ: Mapping[str, str], default_port: int) -> DistEnv:
    port_text = environ.get("MASTER_PORT")
    port = _int(environ, "MASTER_PORT") if port_text else None
    mpi_rank = _first(environ, MPI_RANK)
    if ("RANK" in environ) != ("WORLD_SIZE" in environ) and (
            mpi_rank is None or "RANK" in environ):
        have, missing = ("RANK", "WORLD_SIZE") if "RANK" in environ else ("WORLD_SIZE", "RANK")
        raise UsageError(f"{have} is set but {missing} is not", where="environment",
                         hint="set both (a launcher sets both), or neither for one process")
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world = _int(environ, "WORLD_SIZE")
        return DistEnv(
            rank=_int(environ, "RANK"), world_size=world,
            local_rank=_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
            local_world_size=(_int(environ, "LOCAL_WORLD_SIZE")
                              if "LOCAL_WORLD_SIZE" in environ else world),
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=default_port if port is None else port, source="contract")
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        master = environ.get("MASTER_ADDR")
        if not master:
            nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
            if not nodelist:
                raise UsageError("SLURM_PROCID is set but no node list", where="environment",
                                 hint="set MASTER_ADDR, or start the script with srun")
            hosts = expand_hostlist(nodelist)
            if not hosts:
                raise UsageError(f"node list {nodelist!r} names no host", where="environment",
                                 hint="set MASTER_ADDR, or start the script with srun")
            master = hosts[0]
        job_id = environ.get("SLURM_JOB_ID", "0")
        slurm_port = 15000 + int(job_id) % 20000 if job_id.isdigit() else default_port
        ntasks = _int(environ, "SLURM_NTASKS")
        return DistEnv(
            rank=_int(environ, "SLURM_PROCID"), world_size=ntasks,
            local_rank=_int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
            local_world_size=_slurm_local_tasks(environ, ntasks),
            master_addr=master, master_port=slurm_port if port is None else port,
            source="slurm")
    if mpi_rank is not None:
        return _from_mpi(environ, mpi_rank, default_port if port is None else port)
    return DistEnv(0, 1, 0, 1, environ.get("MASTER_ADDR", "127.0.0.1"),
                   _free_port() if port is None else port, "single")


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in environ), None)


def _from_mpi(environ: Mapping[str, str], rank_name: str, port: int) -> DistEnv:
    """A process ``mpirun`` started: rank and world from its MPI's variables; the
    rendezvous from ``MASTER_ADDR`` (which ``ds-run`` exports with ``-x``/``-genv``), or
    loopback when every rank is on this node."""
    size_name = _first(environ, MPI_SIZE)
    if size_name is None:
        raise UsageError(f"{rank_name} is set but no world size ({', '.join(MPI_SIZE)})",
                         where="environment",
                         hint="start the script with mpirun, or set WORLD_SIZE")
    world = _int(environ, size_name)
    local_rank_name = _first(environ, MPI_LOCAL_RANK)
    local_size_name = _first(environ, MPI_LOCAL_SIZE)
    local_size = _int(environ, local_size_name) if local_size_name else None
    master = environ.get("MASTER_ADDR")
    if not master:
        if world > 1 and local_size != world:
            raise UsageError("started by mpirun without MASTER_ADDR", where="environment",
                             hint="pass -x MASTER_ADDR=<first host> -x MASTER_PORT=<port> "
                                  "to mpirun (-genv with MPICH), or launch with ds-run "
                                  "--launcher openmpi|mpich")
        master = "127.0.0.1"
    return DistEnv(
        rank=_int(environ, rank_name), world_size=world,
        local_rank=_int(environ, local_rank_name) if local_rank_name else 0,
        local_world_size=world if local_size is None else local_size,
        master_addr=master, master_port=port, source="mpi")


def mpi_local_rank(environ: Mapping[str, str]) -> str | None:
    """The local rank an MPI launcher gave this process, as text (``None``: none did)."""
    name = _first(environ, MPI_LOCAL_RANK)
    return None if name is None else environ[name]


def _slurm_local_tasks(environ: Mapping[str, str], ntasks: int) -> int:
    # SLURM_TASKS_PER_NODE looks like "2(x3),1"; SLURM_NTASKS_PER_NODE is set only with -N
    text = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "")
    first = text.split(",")[0].split("(")[0]
    return int(first) if first.isdigit() else ntasks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def export_contract(dist_env: DistEnv, environ: MutableMapping[str, str]) -> None:
    """Write the torchrun-style variables, so ``env://`` and user code see one contract."""
    environ.update({
        "RANK": str(dist_env.rank), "WORLD_SIZE": str(dist_env.world_size),
        "LOCAL_RANK": str(dist_env.local_rank),
        "LOCAL_WORLD_SIZE": str(dist_env.local_world_size),
        "MASTER_ADDR": dist_env.master_addr, "MASTER_PORT": str(dist_env.master_port),
    })


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: object = None,
    rank: int = -1,
    world_size: int = -1,
) -> DistEnv:
    """Initialise ``torch.distributed`` for this process once; returns where it sits.

    The signature is DeepSpeed's, so scripts calling ``deepspeed.init_distributed(...)``
    work unchanged.

    Args:
        dist_backend: ``"nccl"``, ``"gloo"``...; by default nccl when CUDA is available,
            gloo otherwise.
        auto_mpi_discovery: read MPI's variables (:data:`MPI_RANK`...) when no launcher
            contract is present (without mpi4py, ``MASTER_ADDR`` must then be exported by
            mpirun, as ``ds-run --launcher openmpi|mpich|impi|mvapich`` does, unless every
            rank runs on this node).
        distributed_port: the rendezvous port when ``MASTER_PORT`` is not set.
        verbose: log the resolved rank, world and rendezvous on rank 0.
        timeout: collective timeout (torch's default when ``None``).
        init_method: a torch init method URL (``tcp://...``, ``file://...``) instead of
            ``env://``.
        dist_init_required: ``False`` skips initialisation, as in DeepSpeed.
        config: accepted for DeepSpeed compatibility (it only configures comms logging
            there); not used.
        rank, world_size: override the environment's values when not -1.

    On CUDA the current device is set to the local rank first. Calling it again, or in a
    process where torch.distributed is already initialised, returns without change. It
    also registers faulthandler on SIGUSR1, with which ds-run's agent has a hung worker
    print its stacks, and installs :func:`deepshard.errors.install_exit_hooks`: an
    uncaught ``UsageError`` is then one line and exit code 2.
    """
    del config  # see the docstring
    install_exit_hooks()
    import torch
    import torch.distributed as dist

    # a hung rank's agent asks for its Python stacks with this signal (--hang_timeout)
    register_stack_dump()

    environ = dict(os.environ)
    if not auto_mpi_discovery:
        environ = {k: v for k, v in environ.items() if k not in MPI_VARIABLES}
    dist_env = resolve_dist_env(environ, default_port=distributed_port)
    if rank != -1 or world_size != -1:
        overrides: dict[str, Any] = {
            "rank": dist_env.rank if rank == -1 else rank,
            "world_size": dist_env.world_size if world_size == -1 else world_size}
        if dist_env.source == "single" and not environ.get("MASTER_PORT"):
            # a free port of our own is useless to the other ranks: use the agreed one
            overrides["master_port"] = distributed_port
        dist_env = _checked(dataclasses.replace(dist_env, **overrides))
    if dist_init_required is False or (dist.is_available() and dist.is_initialized()):
        install_exit_hooks()
        return dist_env
    export_contract(dist_env, os.environ)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(dist_env.local_rank % torch.cuda.device_count())
    backend = dist_backend or ("nccl" if cuda else "gloo")
    kwargs = {} if timeout is None else {"timeout": timeout}
    if verbose and dist_env.rank == 0:
        logger.info("deepshard: initialising %s, world %d, rendezvous %s:%d (from %s)",
                    backend, dist_env.world_size, dist_env.master_addr, dist_env.master_port,
                    dist_env.source)
    dist.init_process_group(backend=backend, init_method=init_method or "env://",
                            rank=dist_env.rank, world_size=dist_env.world_size, **kwargs)
    teardown.register()
    install_exit_hooks()  # again: torch's group wraps the hook in its own (rank prefixes)
    return dist_env
