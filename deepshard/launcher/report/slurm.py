"""``ds_report --slurm``: the preflight of every node of a SLURM allocation (or of ``-w``
nodes), through ``srun`` instead of ssh.

The same probe and verdict as ``-H`` (:mod:`.preflight`), one ``srun --nodes=1`` per node,
all at once in threads: a node that fails to launch (its slurmd down), to be allocated or
to answer in time is its own row with srun's reason, and does not hold up the others (one
multi-node step would fail or hang as a whole). Inside an allocation each probe is an
``--overlap`` step of the job; with ``-w`` outside one, each node is a one-node job of its
own, bounded by ``--immediate``, and cancelled by name if it has to be killed.

Planning (:func:`plan_slurm_preflight`), the srun lines and the reading of a step's result
(:func:`step_check`) are pure; :func:`run_slurm_preflight` runs them.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from deepshard.errors import UsageError
from deepshard.launcher.report.preflight import PROBE, HostCheck, expected_versions, judge
from deepshard.launcher.slurm_env import allocation_resources, in_allocation

KILL_GRACE = 1.0
"""Seconds srun has to end after SIGTERM before SIGKILL: while it launches a step on a
node whose slurmd is gone, srun ignores SIGTERM until its own MessageTimeout (10 s)."""

_PREFIX = re.compile(r"^(?:srun|salloc|slurmstepd(?:-\S+)?): (?:error: )?")

# srun's reason (a substring of its error) -> the fix; the first that matches wins
_FIXES = (
    ("Task launch", "its slurmd does not answer: `scontrol show node {node}`; restart slurmd "
                    "there or leave the node out"),
    ("Invalid node name", "check the name: `sinfo -N` lists the nodes"),
    ("Unable to allocate", "the node is busy, down or not yours: `sinfo -n {node}`; run "
                           "inside an allocation that holds it"),
)


@dataclass(frozen=True, kw_only=True)
class SlurmPreflight:
    """What ``ds_report --slurm`` probes, and how: the nodes and every srun's settings."""

    nodes: tuple[str, ...]
    """The nodes, in the node list's order (the first also checks the master port)."""
    slots: int
    """Slots per node, as ds-run would plan them (the job's GPUs, else 1)."""
    source: str
    """Where the nodes come from: ``SLURM job 42`` or ``-w node[1-3]``."""
    in_allocation: bool
    """Probe as steps of the current job (``--overlap``); else one new job per node."""
    python: str
    """The Python each node runs the probe with."""
    cwd: str
    master_port: int
    timeout: float
    """Seconds each node has to answer (outside an allocation, as long again to be
    allocated: srun ``--immediate``)."""
    launcher_args: tuple[str, ...] = ()
    """Extra srun arguments (``--partition``, ``--account``, ...), after ours."""
    job_name: str = "ds_report"
    """Prefix of the new jobs' names (``<job_name>-<node>``), for scancel."""

    @property
    def immediate(self) -> int:
        return max(1, math.ceil(self.timeout))

    @property
    def deadline(self) -> float:
        """Seconds one node's srun may run before it is killed."""
        return self.timeout if self.in_allocation else self.immediate + self.timeout


@dataclass(frozen=True)
class StepResult:
    """What one node's srun did: ``returncode`` is None when it was killed at the
    deadline; ``start``/``end`` (wall clock) bracket it, and so the probe's clock."""

    stdout: str
    stderr: str
    returncode: int | None
    start: float
    end: float


def plan_slurm_preflight(environ: Mapping[str, str], *, nodelist: str | None,
                         expand: Callable[[str], list[str]], python: str, cwd: str,
                         master_port: int, timeout: float, launcher_args: str = "",
                         job_name: str = "ds_report") -> SlurmPreflight:
    """The nodes to probe: the allocation's (``-w`` picks some of them), else the ``-w``
    nodes as new jobs. ``expand`` turns a node list into names (``expand_nodelist``)."""
    wanted = _expand(nodelist, expand, "-w") if nodelist is not None else None

    def plan(nodes: list[str], slots: int, source: str, allocated: bool) -> SlurmPreflight:
        return SlurmPreflight(nodes=tuple(nodes), slots=slots, source=source,
                              in_allocation=allocated, python=python, cwd=cwd,
                              master_port=master_port, timeout=timeout,
                              launcher_args=tuple(shlex.split(launcher_args)),
                              job_name=job_name)

    if in_allocation(environ):
        job = environ.get("SLURM_JOB_ID", "?")
        listed = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
        hosts = _expand(listed, expand, "SLURM_JOB_NODELIST")
        resources = allocation_resources(environ, hosts, None)
        if wanted is not None:
            outside = [n for n in wanted if n not in hosts]
            if outside:
                raise UsageError(f"{', '.join(outside)} not in SLURM job {job} ({listed})",
                                 where="-w", hint="name nodes of this allocation, or run "
                                 "ds_report -w outside it to allocate them")
        return plan(hosts if wanted is None else wanted, len(resources.hosts[0].slots),
                    f"SLURM job {job}", True)
    if wanted is None:
        raise UsageError("not inside a SLURM allocation (no SLURM_JOB_ID) and no nodes "
                         "named", where="--slurm", hint="run it inside salloc/sbatch, or "
                         "name the nodes: ds_report --slurm -w 'node[1-3]'")
    return plan(wanted, 1, f"-w {nodelist}", False)


def _expand(nodelist: str, expand: Callable[[str], list[str]], where: str) -> list[str]:
    try:
        names = expand(nodelist)
    except UsageError as exc:
        raise UsageError(exc.message, where=where, hint=exc.hint) from None
    if not names:
        raise UsageError(f"node list {nodelist!r} names no node", where=where,
                         hint="expected SLURM's syntax, like node[01-04,07],gpu7")
    return list(dict.fromkeys(names))  # a node named twice is probed once


def srun_command(plan: SlurmPreflight, index: int) -> list[str]:
    """The srun line that runs the probe on node ``index`` (the first checks the port)."""
    node = plan.nodes[index]
    port = plan.master_port if index == 0 else 0
    mode = ["--overlap"] if plan.in_allocation else \
        [f"--immediate={plan.immediate}", f"--job-name={plan.job_name}-{node}"]
    return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", *mode, "--quiet",
            *plan.launcher_args, plan.python, "-c", PROBE, plan.cwd, str(port)]


def cancel_command(plan: SlurmPreflight, index: int) -> list[str] | None:
    """What cancels node ``index``'s job after its srun was killed (None: a step of the
    current job, which ends with it)."""
    if plan.in_allocation:
        return None
    return ["scancel", f"--name={plan.job_name}-{plan.nodes[index]}"]


def step_check(plan: SlurmPreflight, index: int, result: StepResult,
               expected: Mapping[str, str | None]) -> HostCheck:
    """One node's row from its srun's result (pure)."""
    node = plan.nodes[index]
    if result.returncode is None:
        return HostCheck(node, False, problems=[f"no answer within {plan.deadline:g} s "
                                                "(srun killed)"],
                         fixes=[f"check its slurmd: `scontrol show node {node}`; or raise "
                                "--timeout"])
    facts = _last_json(result.stdout)
    if result.returncode != 0 or facts is None:
        reason = _reason(result.stderr) or f"srun exit {result.returncode}"
        # the probe started (and failed) when srun says how its task ended ("node1: task
        # 0: Exited with exit code 2", "... Killed"), or srun exits 0 itself
        ran = result.returncode == 0 or ": task 0: " in result.stderr \
            or "execve" in result.stderr
        if ran:
            return HostCheck(node, True, problems=[f"probe failed: {reason}"],
                             fixes=[f"check that {plan.python} exists there "
                                    "(or --remote_python)"])
        fix = next((f for key, f in _FIXES if key in result.stderr),
                   "see `scontrol show node {node}` and srun's error")
        return HostCheck(node, False, problems=[f"srun: {reason}"],
                         fixes=[fix.format(node=node)])
    # the probe read its clock between start and end: only what lies outside is skew
    probe_time = float(facts.pop("time"))
    skew = probe_time - min(max(probe_time, result.start), result.end)
    return judge(node, facts, plan.slots, dict(expected), skew,
                 plan.master_port if index == 0 else 0)


def _last_json(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        with contextlib.suppress(ValueError):
            value = json.loads(line)
            if isinstance(value, dict) and "time" in value:
                return value
    return None


def _reason(stderr: str) -> str:
    """The line of srun's stderr that says why: the step's own (slurmstepd), else the
    probe's last line (a traceback's), else srun's first error."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    stepd = [line for line in lines if line.startswith("slurmstepd")]
    task = [line for line in lines if not _PREFIX.match(line)]
    errors = [line for line in lines if "error:" in line]
    chosen = stepd[-1] if stepd else task[-1] if task else (errors or lines or [""])[0]
    return _PREFIX.sub("", chosen)


class _Steps:
    """The sruns under way, so that an interrupt (or a deadline) ends them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: dict[int, subprocess.Popen[str]] = {}
        self._stopped = False

    def run(self, plan: SlurmPreflight, index: int) -> StepResult:
        start = time.time()
        proc = subprocess.Popen(srun_command(plan, index), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        with self._lock:
            self._procs[index] = proc
            if self._stopped:  # interrupted while this one was starting
                proc.kill()
        try:
            out, err = proc.communicate(timeout=plan.deadline)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            out, err = self._end(plan, index, proc)
            code = None
        finally:
            with self._lock:
                self._procs.pop(index, None)
        return StepResult(out, err, code, start, time.time())

    def _end(self, plan: SlurmPreflight, index: int,
             proc: subprocess.Popen[str]) -> tuple[str, str]:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=KILL_GRACE)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        cancel = cancel_command(plan, index)
        if cancel is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(cancel, capture_output=True, timeout=10, check=False)
        return out or "", err or ""

    def kill_all(self, plan: SlurmPreflight) -> None:
        with self._lock:
            self._stopped = True
            procs = dict(self._procs)
        for index, proc in procs.items():
            with contextlib.suppress(OSError):
                proc.kill()
            cancel = cancel_command(plan, index)
            if cancel is not None:
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run(cancel, capture_output=True, timeout=10, check=False)


def run_slurm_preflight(plan: SlurmPreflight, *, max_parallel: int = 64) -> list[HostCheck]:
    """Probe every node in parallel, one srun each; one row per node, in the plan's order."""
    expected = expected_versions()
    steps = _Steps()

    def check(index: int) -> HostCheck:
        try:
            return step_check(plan, index, steps.run(plan, index), expected)
        except Exception as exc:  # one odd node must give one FAIL row, not a traceback
            return HostCheck(plan.nodes[index], False,
                             problems=[f"srun failed: {type(exc).__name__}: {exc}"],
                             fixes=["run the probe by hand: srun -w <node> python -c ..."])

    pool = ThreadPoolExecutor(max_workers=min(max_parallel, len(plan.nodes)))
    try:
        return list(pool.map(check, range(len(plan.nodes))))
    except BaseException:  # Ctrl-C: no srun (nor a pending job) outlives ds_report
        pool.shutdown(wait=False, cancel_futures=True)
        steps.kill_all(plan)
        raise
    finally:
        pool.shutdown(wait=True)
