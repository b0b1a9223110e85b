"""The MPI backends (``--launcher openmpi|mpich|impi|mvapich``): one ``mpirun`` for the job.

Each of DeepSpeed 0.19.8's MPI runners (``deepspeed/launcher/multinode_runner.py``) is one
:class:`MpiRunner` row of :data:`RUNNERS`: its name, how ``ds-run`` checks the installed
``mpirun`` is that MPI, the variables it always exports, and the function that writes its
command line exactly as DeepSpeed does for the same hostfile and flags (``--launcher_args``
appended where DeepSpeed appends them). :class:`MpiBackend` runs that line.

Design: like DeepSpeed, mpirun starts the user's script itself on every slot (one process
per rank), not one deepshard agent per node (``--map-by ppr:1:node``). That keeps what users
choose an MPI launcher for: the ranks are real MPI processes (``mpi4py``, an MPI-aware NCCL
plugin, the site's mpirun wrappers and binding flags work), and the command line is
DeepSpeed's, character for character, but for the additions listed below. An agent under
mpirun would be a process MPI knows as a rank whose children it does not, and would need a
channel mpirun does not give (it forwards stdin to rank 0 only). The workers derive the
contract (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE) from their MPI's variables in
``deepshard.init_distributed()`` (:data:`deepshard.comm.distributed.MPI_RANK`...), and
MASTER_ADDR/MASTER_PORT from exports of this line.

ds-run supervises the one mpirun process: its exit code is the job's (a rank that fails
makes mpirun end the job; Open MPI names the first failed rank, which ds-run reports as
its other backends do), and Ctrl-C, SIGTERM or a failure send SIGTERM to mpirun, which
tears down every rank on every host (SIGKILL after the stop grace). ``--max_restarts``
works (each attempt is a new mpirun with a fresh port and DEEPSHARD_RESTART_COUNT).
What deepshard's agents give and mpirun does not, is refused rather than silently dropped
(:func:`refusals`): ``--hang_timeout`` (heartbeats, stack dumps), ``--log_dir``,
``--bind_cores_to_rank`` (use mpirun's binding flags), ``--elastic_training``; the live
view shows each rank running/done only (no step, RSS, GPU), and output is mpirun's,
without ``[host:rank]`` prefixes. DeepSpeed's ``--include``/``--exclude``/``--num_nodes``/
``--num_gpus`` refusals are kept (write the hostfile instead).

Additions to DeepSpeed's line: ``MASTER_ADDR``/``MASTER_PORT`` exports (DeepSpeed's Open
MPI and MVAPICH workers find them with mpi4py; deepshard needs no mpi4py) and
``DEEPSHARD_RUN_ID``/``DEEPSHARD_RESTART_COUNT`` (checkpoint resume after a restart).
Differences: the MPICH line runs the script directly instead of DeepSpeed's
``launcher_helper.py`` (whose only job, RANK/LOCAL_RANK from PMI_RANK/MPI_LOCALRANKID, the
worker does); values are exported verbatim (DeepSpeed wraps values with spaces or shell
characters in double quotes, which, without a shell, end up in the value), and deepshard's
wider set of variables is exported (:data:`~deepshard.launcher.plan.EXPORT_PREFIXES`);
MVAPICH's host list goes to a file per run, not the shared ``/tmp`` path.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepshard import contract
from deepshard.errors import UsageError
from deepshard.launcher.backends.base import AgentHandle, Backend
from deepshard.launcher.hostfile import read_hostfile
from deepshard.launcher.plan import NodePlan, worker_argv
from deepshard.launcher.spawn import DEFAULT_HOSTFILE

if TYPE_CHECKING:
    from deepshard.launcher.options import LaunchOptions

OUTPUT_TAIL = 200
"""mpirun output lines kept to find which rank failed first."""
_NOT_EXPORTED = frozenset({contract.WORLD_SIZE, contract.LOCAL_WORLD_SIZE, contract.NODE_RANK,
                           contract.MASTER_ADDR, contract.MASTER_PORT,
                           contract.CUDA_VISIBLE_DEVICES})
"""Contract variables of a node plan that are not exported as they are: per node, or
written where DeepSpeed writes them."""
_ADDED = (contract.RUN_ID, contract.RESTART_COUNT, contract.ELASTIC)


@dataclass(frozen=True)
class MpiJob:
    """What an MPI command line is built from (pure data, from the plan and the options)."""

    hosts: tuple[tuple[str, int], ...]
    """(host, slots) in hostfile order: ranks are placed host-major, as mpirun places them."""
    hostfile: str
    """The hostfile as given (Open MPI reads it itself: ``host slots=N`` is its format)."""
    exports: tuple[tuple[str, str], ...]
    """DeepSpeed's exports: the runner's defaults, the environment's, ``.deepspeed_env``."""
    added: tuple[tuple[str, str], ...]
    """deepshard's additions: MASTER_ADDR, MASTER_PORT, then the run's contract."""
    argv: tuple[str, ...]
    """One rank's command line (``python -u [-m] script args``; no ``--local_rank``)."""
    launcher_args: tuple[str, ...]
    mvapich_hostfile: str = ""

    @property
    def world(self) -> int:
        return sum(n for _, n in self.hosts)


def _per_node(job: MpiJob, name: str) -> int:
    """Slots per host, which must be the same on every host (DeepSpeed's ``-ppn``)."""
    counts = {n for _, n in job.hosts}
    if len(counts) > 1:
        shown = ", ".join(f"{h} slots={n}" for h, n in job.hosts)
        raise UsageError(f"--launcher {name} runs the same number of ranks on every host, "
                         f"but the hostfile has {shown}", where=job.hostfile,
                         hint="give every host the same slots=N, or use --launcher openmpi")
    return job.hosts[0][1]


def openmpi_command(job: MpiJob) -> list[str]:
    """DeepSpeed's ``OpenMPIRunner.get_cmd``."""
    args = list(job.launcher_args)
    btl_tcp = ["--mca", "btl_tcp_if_include", "eth0"]
    if any(a in ("-mca", "--mca") and b == "btl_tcp_if_include"
           for a, b in itertools.pairwise(args)):
        btl_tcp = []
    exports = [f for k, v in (*job.exports, *job.added) for f in ("-x", f"{k}={v}")]
    return ["mpirun", "-n", str(job.world), "-hostfile", job.hostfile, "--mca", "btl",
            "^openib", *btl_tcp, *args, *exports, *job.argv]


def mpich_command(job: MpiJob) -> list[str]:
    """DeepSpeed's ``MPICHRunner.get_cmd``, with the script in place of its helper."""
    ppn = _per_node(job, "mpich")
    master, port, *rest = job.added
    return ["mpirun", "-n", str(job.world), "-ppn", str(ppn), *job.launcher_args,
            *[f for k, v in job.exports for f in ("-genv", f"{k}={v}")],
            "-genv", master[0], master[1], "-genv", port[0], port[1],
            "-genv", "WORLD_SIZE", str(job.world), "-genv", "LOCAL_SIZE", str(ppn),
            *[f for k, v in rest for f in ("-genv", f"{k}={v}")],
            "-hosts", ",".join(h for h, _ in job.hosts), *job.argv]


def impi_command(job: MpiJob) -> list[str]:
    """DeepSpeed's ``IMPIRunner.get_cmd`` (``--bind_cores_to_rank`` is refused)."""
    ppn = _per_node(job, "impi")
    master, port, *rest = job.added
    head = ["mpirun", "-ppn", str(ppn), *job.launcher_args,
            *[f for k, v in job.exports for f in ("-genv", k, v)],
            "-genv", master[0], master[1], "-genv", port[0], port[1],
            "-genv", "WORLD_SIZE", str(job.world), "-genv", "LOCAL_SIZE", str(ppn),
            "-genv", "I_MPI_PIN", "0", *[f for k, v in rest for f in ("-genv", k, v)],
            "-hosts", ",".join(h for h, _ in job.hosts)]
    ranks: list[str] = []
    for rank in range(job.world):
        ranks += [*([":"] if rank else []), "-n", "1", "-env", "RANK", str(rank),
                  "-env", "LOCAL_RANK", str(rank % ppn), *job.argv]
    return head + ranks


def mvapich_command(job: MpiJob) -> list[str]:
    """DeepSpeed's ``MVAPICHRunner.get_cmd`` (its host list file is written by
    :meth:`MpiBackend.prepare`)."""
    ppn = _per_node(job, "mvapich")
    return ["mpirun", "-np", str(job.world), "-ppn", str(ppn), "--hostfile",
            job.mvapich_hostfile, *job.launcher_args,
            *[f for k, v in (*job.exports, *job.added) for f in ("-env", f"{k}={v}")],
            *job.argv]


@dataclass(frozen=True)
class MpiRunner:
    """One of DeepSpeed's MPI runners, as data."""

    name: str
    summary: str
    """For ``ds-run --help``."""
    command: Callable[[MpiJob], list[str]]
    is_this_mpi: Callable[[str], bool]
    """Whether ``mpirun --version``'s output is this MPI's."""
    package: str
    """What to install, for the hint when mpirun is missing or another MPI's."""
    defaults: tuple[tuple[str, str], ...] = ()
    """Variables DeepSpeed's runner always exports (the environment may override them)."""


def _open_mpi(version: str) -> bool:
    return "Open MPI" in version or "OpenRTE" in version


RUNNERS: dict[str, MpiRunner] = {
    "openmpi": MpiRunner("openmpi", "Open MPI's mpirun, one process per slot",
                         openmpi_command, _open_mpi, "openmpi-bin",
                         defaults=(("UCX_TLS", "tcp"),)),
    "mpich": MpiRunner("mpich", "MPICH's mpirun (hydra)", mpich_command,
                       lambda v: not _open_mpi(v), "mpich"),
    "impi": MpiRunner("impi", "Intel MPI's mpirun", impi_command,
                      lambda v: not _open_mpi(v), "Intel MPI (intel-oneapi-mpi)"),
    "mvapich": MpiRunner("mvapich", "MVAPICH2's mpirun", mvapich_command,
                         lambda v: not _open_mpi(v), "MVAPICH2-GDR",
                         defaults=(("MV2_SMP_USE_CMA", "0"), ("MV2_DEBUG_SHOW_BACKTRACE", "1"),
                                   ("MV2_SUPPORT_DL", "1"), ("MV2_ENABLE_AFFINITY", "0"),
                                   ("MV2_INTER_ALLGATHER_TUNING", "5"),
                                   ("MV2_CUDA_USE_NAIVE", "0"))),
}
"""DeepSpeed's MPI runners by ``--launcher`` name. (DeepSpeed's MVAPICH also exports
``MV2_USE_CUDA=1`` when its accelerator is CUDA: the launcher cannot import torch to know,
so that one is left to ``.deepspeed_env``.)"""


def refusals(options: LaunchOptions) -> list[tuple[str, str]]:
    """(flag, hint) for each flag an MPI launch cannot honour, in the order given."""
    found = []
    if options.include or options.exclude or options.num_nodes or options.num_gpus:
        flag = next(f for f, v in (("--include", options.include),
                                   ("--exclude", options.exclude),
                                   ("--num_nodes", options.num_nodes),
                                   ("--num_gpus", options.num_gpus)) if v)
        found.append((flag, "mpirun runs every slot of the hostfile (as DeepSpeed's MPI "
                            "runners): write a hostfile with only the hosts and slots to use"))
    for flag, value, hint in (
            ("--hang_timeout", options.hang_timeout, "hang detection needs deepshard's "
             "agents: use --launcher ssh or pdsh"),
            ("--log_dir", options.log_dir, "use mpirun's own, e.g. --launcher_args "
             "'--output-filename DIR' with Open MPI"),
            ("--bind_cores_to_rank", options.bind_cores_to_rank, "use mpirun's binding "
             "flags in --launcher_args (e.g. '--bind-to core')"),
            ("--elastic_training", options.elastic_training, "elastic membership needs "
             "deepshard's agents: use --launcher ssh or pdsh")):
        if value:
            found.append((flag, hint))
    return found


def build_job(options: LaunchOptions, runner: MpiRunner, node: NodePlan,
              hosts: tuple[tuple[str, int], ...], *, python: str) -> MpiJob:
    """The job of ``runner`` for ``hosts``; the variables come from ``node``'s plan (a
    remote node's: the environment's exported prefixes, ``.deepspeed_env``, the contract)."""
    env = dict(node.env)
    exports = dict(runner.defaults)
    exports.update((k, v) for k, v in node.env if k not in _NOT_EXPORTED and k not in _ADDED)
    # DeepSpeed puts the working directory first on PYTHONPATH for every MPI launch
    path = [node.cwd, *([exports["PYTHONPATH"]] if exports.get("PYTHONPATH") else [])]
    exports["PYTHONPATH"] = os.pathsep.join(path)
    if node.deepspeed_compat:  # what the agent does for its workers: `import deepspeed` is ours
        exports["PYTHONPATH"] = contract.prepend_to_path(contract.SHIM_DIR,
                                                         exports["PYTHONPATH"])
    added = ((contract.MASTER_ADDR, env[contract.MASTER_ADDR]),
             (contract.MASTER_PORT, env[contract.MASTER_PORT]),
             *((k, env[k]) for k in _ADDED if k in env))
    hostfile = options.hostfile or DEFAULT_HOSTFILE
    return MpiJob(
        hosts=hosts, hostfile=hostfile, exports=tuple(exports.items()), added=added,
        argv=worker_argv(dataclasses.replace(options, no_local_rank=True), python, 0),
        launcher_args=tuple(shlex.split(options.launcher_args)),
        mvapich_hostfile=os.path.join(tempfile.gettempdir(), "deepshard_mvapich_hostfile_"
                                      + env.get(contract.RUN_ID, "run")))


# -- the running job ------------------------------------------------------------------------
_OMPI_EXIT = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]\s*Exit code:\s*(-?\d+)")
_OMPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")


def first_failure(output: str) -> tuple[int, int] | None:
    """(rank, Popen-style return code) of the first failed rank, when mpirun's output says
    (Open MPI does; MPICH's hydra names a pid and host only)."""
    found = [(m.start(), int(m[1]), int(m[2])) for m in _OMPI_EXIT.finditer(output)]
    found += [(m.start(), int(m[1]), -int(m[2])) for m in _OMPI_SIGNAL.finditer(output)]
    if not found:
        return None
    _, rank, code = min(found)
    return rank, code


class _MpiRun:
    """The one mpirun process: its output goes to the first node's channel; its end is
    told on every node's."""

    def __init__(self, argv: list[str], nodes: tuple[NodePlan, ...]):
        self.nodes = nodes
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.queues: dict[str, queue.SimpleQueue[str | None]] = {
            n.host: queue.SimpleQueue() for n in nodes}
        self.tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL)
        self.stopped = False
        threading.Thread(target=self._pump, daemon=True, name="mpirun-out").start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        first = self.queues[self.nodes[0].host]
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "surrogateescape")
            self.tail.append(line)
            first.put(line)
        self.proc.wait()
        for q in self.queues.values():
            q.put(None)

    def stop(self) -> None:
        """SIGTERM to mpirun, which ends every rank on every host. Idempotent."""
        if not self.stopped and self.proc.poll() is None:
            self.stopped = True
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class MpiAgent(AgentHandle):
    """One node's view of the mpirun: ``alive`` while it runs, then how it ended."""

    def __init__(self, node: NodePlan, run: _MpiRun):
        self.node = node
        self._run = run

    def lines(self) -> Iterator[str]:
        ranks = [w.rank for w in self.node.workers]
        q = self._run.queues[self.node.host]
        alive = contract.Alive(workers={r: contract.WorkerStats() for r in ranks})
        while True:
            try:
                line = q.get(timeout=contract.ALIVE_INTERVAL)
            except queue.Empty:
                yield contract.format_event(alive)
                continue
            if line is None:
                break
            # a rank's line that reads as protocol must not be taken for one
            yield (" " + line) if contract.decode_line(line) is not None else line
        yield from self._ending(ranks)

    def _ending(self, ranks: list[int]) -> Iterator[str]:
        code = self._run.proc.returncode
        if code == 0:
            for rank in ranks:
                yield contract.format_event(contract.Exited(rank=rank, returncode=0))
            yield contract.format_event(contract.Done(state="succeeded"))
            return
        failed = first_failure("".join(self._run.tail))
        if failed is not None and failed[0] in ranks:
            rank, rc = failed
            yield contract.encode_output(rank, f"(mpirun: rank {rank} failed first; its "
                                               "output is mpirun's, above)")
            yield contract.format_event(contract.Exited(rank=rank, returncode=rc))
        elif failed is None and self.node is self._run.nodes[0] and not self._run.stopped:
            how = (f"exit code {code}" if code > 0 else f"signal {-code}")
            yield contract.format_event(contract.AgentError(
                message=f"mpirun ended with {how} (its output, above, says which rank "
                        "or host failed)"))
        state = "stopped" if self._run.stopped else "failed"
        yield contract.format_event(contract.Done(state=state, reason="mpirun ended"))

    def stop(self) -> None:
        self._run.stop()

    def wait(self, timeout: float) -> int | None:
        try:
            return self._run.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self._run.kill()

    def diagnostics(self) -> list[str]:
        return [line.rstrip("\n") for line in list(self._run.tail)[-3:]]


class MpiBackend(Backend):
    """Starts the whole job with one mpirun of :attr:`runner`'s MPI."""

    runner: MpiRunner

    def __init__(self, options: LaunchOptions, *, python: str | None = None):
        self.options = options
        self.python = python or options.remote_python or sys.executable
        self._argv: list[str] | None = None
        self._nodes: tuple[NodePlan, ...] = ()
        self._run: _MpiRun | None = None

    @classmethod
    def from_options(cls, options: LaunchOptions) -> MpiBackend:
        for flag, hint in refusals(options):
            raise UsageError(f"--launcher {options.launcher} cannot honour it", where=flag,
                             hint=hint)
        return cls(options)

    def command(self, nodes: tuple[NodePlan, ...]) -> list[str]:
        """The mpirun line for the plan's nodes (every node of the job)."""
        world = int(dict(nodes[0].env)[contract.WORLD_SIZE])
        if sum(len(n.workers) for n in nodes) != world:
            raise UsageError(
                f"--launcher {self.runner.name} starts every host with mpirun, but some "
                "host of the hostfile is this machine, which ds-run runs itself",
                where=self.options.hostfile or DEFAULT_HOSTFILE,
                hint="name this machine by an address mpirun reaches it at (not localhost "
                     "or its own name), or drop --launcher to use ds-run's agents")
        hosts = tuple((n.host, len(n.workers)) for n in nodes)
        job = build_job(self.options, self.runner, nodes[0], hosts, python=self.python)
        return self.runner.command(job)

    def shown_command(self, node: NodePlan) -> list[str] | None:
        """For ``--dry_run``, on the first node only: the whole job's line."""
        if node.node_rank != 0:
            return None
        resources = read_hostfile(self.options.hostfile or DEFAULT_HOSTFILE)
        world = sum(len(h.slots) for h in resources.hosts)
        nodes = tuple(dataclasses.replace(node, host=h.name, node_rank=i,
                                          workers=node.workers[:1] * len(h.slots))
                      for i, h in enumerate(resources.hosts))
        assert sum(len(n.workers) for n in nodes) == world
        return self.command(nodes)

    def prepare(self, nodes: tuple[NodePlan, ...]) -> None:
        self.close()  # the previous attempt's mpirun, if any
        self._run = None
        mpirun = shutil.which("mpirun")
        hint = f"install {self.runner.package}, or put its mpirun first on PATH"
        if mpirun is None:
            raise UsageError(f"--launcher {self.runner.name}, but mpirun is not on PATH",
                             hint=hint)
        try:
            version = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                                     timeout=30, check=False, stdin=subprocess.DEVNULL)
            said = version.stdout + version.stderr
        except (OSError, subprocess.SubprocessError) as exc:
            said = str(exc)
        if not self.runner.is_this_mpi(said):
            first = next((line.strip() for line in said.splitlines() if line.strip()), "")
            raise UsageError(f"--launcher {self.runner.name}, but {mpirun} is another MPI's "
                             f"({first!r})", hint=hint)
        self._nodes = nodes
        self._argv = self.command(nodes)
        if self.runner.name == "mvapich":
            index = self._argv.index("--hostfile") + 1
            with open(self._argv[index], "w") as out:
                out.writelines(f"{n.host}\n" for n in nodes)

    def start(self, node: NodePlan) -> AgentHandle:
        if self._run is None:
            assert self._argv is not None, "prepare() comes first"
            self._run = _MpiRun(self._argv, self._nodes)
        return MpiAgent(node, self._run)

    def close(self) -> None:
        if self._run is not None and self._run.proc.poll() is None:
            self._run.kill()
            self._run.proc.wait()


def _backend(runner: MpiRunner) -> type[MpiBackend]:
    return type(f"{runner.name.capitalize()}Backend", (MpiBackend,),
                {"runner": runner, "name": runner.name, "__doc__": f"``--launcher {runner.name}``: "
                 f"{runner.summary}.", "__module__": __name__})


OpenmpiBackend = _backend(RUNNERS["openmpi"])
MpichBackend = _backend(RUNNERS["mpich"])
ImpiBackend = _backend(RUNNERS["impi"])
MvapichBackend = _backend(RUNNERS["mvapich"])
