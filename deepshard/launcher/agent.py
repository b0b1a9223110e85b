"""The per-node agent: starts this node's workers, relays their output, and stops them.

Run as ``python -c <spawn.AGENT_ARGS>`` (or ``python -m deepshard.launcher.agent``); the
first line on stdin is the :class:`~.plan.NodePlan` as JSON. The agent then

* starts one worker per slot, each in its own session (process group), with the env
  contract, ``OMP_NUM_THREADS`` (cores / workers unless the user set it) and, when asked,
  its own cores;
* relays every output line (stdout and stderr merged) on its stdout, and to
  ``<log_dir>/rank_<N>.log`` when a log directory is given;
* reports ``started``/``exited``/``hung``/``done`` events (:mod:`deepshard.contract`),
  and every second an ``alive`` event with each worker's step, heartbeat age, RSS and CPU,
  the times of the steps it finished since (for straggler detection) and the GPUs' memory
  (its liveness for the coordinator);
* gives each worker a heartbeat file (:mod:`deepshard.liveness`); with a hang timeout, a
  worker that has beaten and then goes silent that long has its stacks dumped (SIGUSR1)
  and fails the node;
* stops every worker (SIGTERM, grace, SIGKILL, to the whole process group and to any
  orphaned descendant, which it collects as the child subreaper) when a worker fails or
  hangs, when it receives SIGTERM/SIGINT/SIGHUP, when its stdin closes (it dies with its
  channel), or when the coordinator's pings stop for the lease.

States: STARTING → RUNNING → (SUCCEEDED | FAILED | STOPPED). Its exit code is 0 only
when every worker exited with 0.
"""

from __future__ import annotations

import codecs
import contextlib
import enum
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import types

from deepshard import contract
from deepshard.launcher import procs
from deepshard.liveness import (
    FILE_SIZE,
    STACK_DUMP_SIGNAL,
    read_checkpoint,
    read_heartbeat,
    read_steps,
)

# Start-up cost matters here (one agent per host, all at once): no dataclasses, pathlib or
# typing at run time. The plan is read as plain JSON (see read_node_plan).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, BinaryIO

    from deepshard.launcher.plan import NodePlan, WorkerPlan

_MAX_LINE = 1 << 16


class AgentState(enum.Enum):
    """STARTING → RUNNING when every worker started (→ FAILED if one cannot start);
    RUNNING → SUCCEEDED when all exited with 0, → FAILED on the first non-zero exit,
    → STOPPED when told to stop (signal or closed channel). Every end state has stopped
    all workers."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class _Worker:
    __slots__ = ("beat_file", "last_step", "plan", "proc", "reader", "reported", "returncode",
                 "stats", "steps_read")

    def __init__(self, plan: WorkerPlan, proc: subprocess.Popen[bytes],
                 reader: threading.Thread, beat_file: str):
        self.plan = plan
        self.proc = proc
        self.reader = reader
        self.beat_file = beat_file
        self.returncode: int | None = None
        self.reported = False
        self.stats: Any = None  # psutil.Process, once stats are first read
        self.steps_read = 0  # step records of its heartbeat file read so far
        self.last_step = -1  # the last step whose time was reported

    def new_step_times(self) -> tuple[contract.StepTime, ...]:
        """The steps it finished since the last call (:func:`.liveness.read_steps`)."""
        self.steps_read, records = read_steps(self.beat_file, self.steps_read)
        times = []
        for step, step_ns, busy_ns in records:
            if step > self.last_step:  # a record read twice (see read_steps) counts once
                self.last_step = step
                times.append(contract.StepTime(step=step, seconds=step_ns / 1e9,
                                               busy=busy_ns / 1e9 if busy_ns >= 0 else None))
        return tuple(times)


class _Channel:
    """Thread-safe writer of protocol lines; notices when the coordinator is gone."""

    def __init__(self, stream: BinaryIO, on_broken: Callable[[], None]):
        self._stream = stream
        self._lock = threading.Lock()
        self._on_broken = on_broken
        self.broken = False

    def write(self, line: str) -> None:
        with self._lock:
            if self.broken:
                return
            try:
                self._stream.write(line.encode("utf-8", "surrogateescape"))
                self._stream.flush()
            except (BrokenPipeError, OSError, ValueError):
                self.broken = True
                self._on_broken()


class _Probe:
    """RSS and CPU per worker (psutil) and GPU memory and use (NVML, when present), each
    imported on first use: after the workers have started, never on the start-up path."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._nvml_tried = False

    def worker(self, w: _Worker) -> tuple[int | None, float | None]:
        """(RSS of its process tree in bytes, CPU percent of its process), or Nones."""
        import psutil

        try:
            if w.stats is None:
                w.stats = psutil.Process(w.proc.pid)
                w.stats.cpu_percent()  # the first call only starts the measurement
            proc = w.stats
            tree = [proc, *proc.children(recursive=True)]
            rss = 0
            for p in tree:
                with contextlib.suppress(psutil.Error):
                    rss += p.memory_info().rss
            return rss, proc.cpu_percent()
        except psutil.Error:
            return None, None

    def gpus(self) -> tuple[contract.GpuStats, ...]:
        if not self._nvml_tried:
            self._nvml_tried = True
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:  # no nvidia-ml-py, or no driver: no GPU stats
                self._nvml = None
        nvml = self._nvml
        if nvml is None:
            return ()
        found = []
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                found.append(contract.GpuStats(index=i, mem_used=mem.used,
                                               mem_total=mem.total, util=util.gpu))
        except Exception:  # a device that vanished mid-read: report what was read
            pass
        return tuple(found)


def core_sets(cores: list[int], workers: int) -> list[list[int]]:
    """Disjoint, equal blocks of cores per worker; round-robin single cores if too few."""
    per = len(cores) // workers
    if per == 0:
        return [[cores[i % len(cores)]] for i in range(workers)]
    return [cores[i * per:(i + 1) * per] for i in range(workers)]


class Agent:
    """Runs one node's workers to completion (see the module docstring)."""

    def __init__(self, node: NodePlan, out: BinaryIO):
        self.node = node
        self.state = AgentState.STARTING
        # a stop request (its reason), or a worker that exited (with its return code)
        self._events: queue.SimpleQueue[str | tuple[_Worker, int]] = queue.SimpleQueue()
        self._channel = _Channel(out, lambda: self._events.put("channel closed"))
        self._workers: list[_Worker] = []
        self._last_heard = time.monotonic()
        self._stop_reason = ""
        self._beat_dir = ""
        self._probe = _Probe()

    def renew_lease(self) -> None:
        """The coordinator spoke (safe from any thread)."""
        self._last_heard = time.monotonic()

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        procs.become_subreaper()
        try:
            self._start_workers()
        except OSError as exc:
            self._send(contract.AgentError(
                host=self.node.host,
                message=f"cannot start worker: {exc.strerror or exc}: {exc.filename or ''}"))
            self.state = AgentState.FAILED
            self._stop_all()
        else:
            self.state = AgentState.RUNNING
            self._send(contract.Started(host=self.node.host,
                                        pids={w.plan.rank: w.proc.pid for w in self._workers}))
            self._monitor()
        self._remove_beat_files()
        self._send(contract.Done(host=self.node.host, state=self.state.value,
                                 reason=self._stop_reason))
        return 0 if self.state is AgentState.SUCCEEDED else 1

    def _send(self, event: contract.AgentEvent) -> None:
        self._channel.write(contract.format_event(event))

    def _remove_beat_files(self) -> None:
        if not self._beat_dir:
            return
        for w in self._workers:
            with contextlib.suppress(OSError):
                os.remove(w.beat_file)
        with contextlib.suppress(OSError):
            os.rmdir(self._beat_dir)

    def stop_now(self) -> None:
        """Stop every worker from the calling thread (the agent's last resort)."""
        self._stop_all()

    def request_stop(self, reason: str) -> None:
        """Ask the monitor loop to stop all workers (safe from signal handlers)."""
        self._events.put(reason)

    def _monitor(self) -> None:
        pending = len(self._workers)
        next_tick = time.monotonic() + contract.ALIVE_INTERVAL
        while pending:
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + contract.ALIVE_INTERVAL
                end = self._tick(now)
                if end is not None:
                    self._end(*end)
                    return
                continue
            try:
                item = self._events.get(timeout=next_tick - now)
            except queue.Empty:
                continue
            if isinstance(item, str):  # asked to stop: a signal, the channel closed
                self._end(AgentState.STOPPED, item)
                return
            worker, returncode = item
            pending -= 1
            self._report_exit(worker, returncode)
            if returncode != 0:
                self._end(AgentState.FAILED)
                return
        self._end(AgentState.SUCCEEDED)  # reaps what the workers left behind

    def _end(self, state: AgentState, reason: str = "") -> None:
        self.state = state
        self._stop_reason = reason
        self._stop_all()

    def _tick(self, now: float) -> tuple[AgentState, str] | None:
        """Once a second: report liveness and stats; check the lease and for hung workers.
        Returns how the node ends (state, reason) when it must end now."""
        now_ns = time.monotonic_ns()
        workers: dict[int, contract.WorkerStats] = {}
        hung: list[tuple[float, int, _Worker, int]] = []
        for w in self._workers:
            if w.returncode is not None:
                continue
            try:
                beat_ns, step, beat_pid, loss = read_heartbeat(w.beat_file)
                ckpt = read_checkpoint(w.beat_file)
                times = w.new_step_times()
            except OSError:
                beat_ns, step, beat_pid, loss, ckpt, times = 0, -1, 0, None, -1, ()
            age = (now_ns - beat_ns) / 1e9 if beat_ns else None
            rss, cpu = self._probe.worker(w)
            workers[w.plan.rank] = contract.WorkerStats(step=step, beat_age=age, rss=rss,
                                                        cpu=cpu, loss=loss, ckpt=ckpt,
                                                        times=times)
            hang = self.node.hang_timeout
            if hang and age is not None and age > hang:
                hung.append((-age, step, w, beat_pid))
        self._send(contract.Alive(host=self.node.host, workers=workers,
                                  gpus=self._probe.gpus()))
        if hung:
            # ranks waiting in a collective for a stuck one stall too: dump them all, and
            # name the one silent longest (then: furthest behind, then lowest rank)
            hung.sort(key=lambda h: (h[0], h[1], h[2].plan.rank))
            self._dump_stacks([(w, pid) for _, _, w, pid in hung], -hung[0][0])
            return AgentState.FAILED, ""
        if self.node.lease_timeout and now - self._last_heard > self.node.lease_timeout:
            return AgentState.STOPPED, "the coordinator is unreachable"
        return None

    def _dump_stacks(self, hung: list[tuple[_Worker, int]], silent: float) -> None:
        """Have hung workers print their Python stacks (faulthandler) into their output:
        the signal goes to the process that heartbeat (which registered the handler), and
        only when it is still one of this worker's processes."""
        dumped = False
        for worker, pid in hung:
            if pid and (pid == worker.proc.pid or pid in procs.descendants(worker.proc.pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, STACK_DUMP_SIGNAL)
                    dumped = True
        if dumped:
            time.sleep(0.5)  # the dumps travel through the workers' pipes to their logs
        self._send(contract.Hung(host=self.node.host, rank=hung[0][0].plan.rank,
                                 silent=silent, ranks=tuple(sorted(w.plan.rank for w, _ in hung)),
                                 dumped=dumped))

    # -- workers -----------------------------------------------------------------------------
    def _start_workers(self) -> None:
        node = self.node
        base = dict(os.environ)
        base.update(node.env)
        if node.deepspeed_compat:  # this node's own install: paths may differ between nodes
            from deepshard.contract import SHIM_DIR, prepend_to_path

            base["PYTHONPATH"] = prepend_to_path(SHIM_DIR, base.get("PYTHONPATH"))
        cores = sorted(os.sched_getaffinity(0))
        blocks = core_sets(cores, len(node.workers)) if node.bind_cores_to_rank else None
        if node.log_dir:
            os.makedirs(node.log_dir, exist_ok=True)
        # not tempfile.mkdtemp: its import costs 10 ms of every agent's start
        base_dir = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
        _remove_stale_beat_dirs(base_dir)
        self._beat_dir = os.path.join(base_dir,
                                      f"deepshard-beats-{os.getpid()}-{os.urandom(4).hex()}")
        os.mkdir(self._beat_dir, 0o700)
        for i, plan in enumerate(node.workers):
            env = dict(base)
            env.update(plan.env)
            beat_file = os.path.join(self._beat_dir, f"rank_{plan.rank}")
            with open(beat_file, "wb") as f:
                f.write(bytes(FILE_SIZE))
            env[contract.HEARTBEAT_FILE] = beat_file
            if contract.OMP_NUM_THREADS not in env:
                threads = len(blocks[i]) if blocks else max(1, len(cores) // len(node.workers))
                env[contract.OMP_NUM_THREADS] = str(threads)
            proc = subprocess.Popen(
                list(plan.argv), env=env, cwd=node.cwd, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            )
            if blocks:
                with contextlib.suppress(OSError):  # it may already have exited
                    os.sched_setaffinity(proc.pid, blocks[i])
            log = self._open_log(plan.rank)
            reader = threading.Thread(target=self._relay, args=(plan.rank, proc, log),
                                      daemon=True, name=f"relay-{plan.rank}")
            worker = _Worker(plan, proc, reader, beat_file)
            reader.start()
            threading.Thread(target=self._wait, args=(worker,), daemon=True,
                             name=f"wait-{plan.rank}").start()
            self._workers.append(worker)

    def _open_log(self, rank: int) -> BinaryIO | None:
        if not self.node.log_dir:
            return None
        return open(os.path.join(self.node.log_dir, f"rank_{rank}.log"), "ab", buffering=0)

    def _relay(self, rank: int, proc: subprocess.Popen[bytes], log: BinaryIO | None) -> None:
        stdout = proc.stdout
        assert stdout is not None
        # incremental: a line longer than _MAX_LINE is relayed in pieces, and a character
        # cut at a piece's end must not turn into replacement characters
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        try:
            for raw in iter(lambda: stdout.readline(_MAX_LINE), b""):
                if log is not None:
                    log.write(raw)
                end = raw.endswith(b"\n")
                text = decoder.decode(raw[:-1] if end else raw, final=end)
                self._channel.write(contract.encode_output(rank, text))
        finally:
            if log is not None:
                log.close()

    def _wait(self, worker: _Worker) -> None:
        returncode = worker.returncode = worker.proc.wait()
        self._events.put((worker, returncode))

    def _report_exit(self, worker: _Worker, returncode: int) -> None:
        # output a child printed before dying reaches the coordinator before its exit event;
        # a grandchild holding the pipe open must not delay the report for long
        worker.reader.join(timeout=0.25)
        worker.reported = True
        self._send(contract.Exited(host=self.node.host, rank=worker.plan.rank,
                                   returncode=returncode))

    def _stop_all(self) -> None:
        """TERM each remaining worker's process group and every other descendant once,
        give all of them the grace to exit, KILL the rest; then report every exit."""
        live = {w.proc.pid for w in self._workers if w.returncode is None}
        procs.stop_tree(live, self.node.stop_grace, keep={w.proc.pid for w in self._workers})
        for w in self._workers:
            if not w.reported:
                returncode = w.returncode = w.proc.wait()
                self._report_exit(w, returncode)


def _remove_stale_beat_dirs(base_dir: str) -> None:
    """Heartbeat directories of agents that died without cleaning up (SIGKILL)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(base_dir):
            parts = name.split("-")
            if name.startswith("deepshard-beats-") and len(parts) == 4 and parts[2].isdigit():
                if os.path.exists(f"/proc/{parts[2]}"):
                    continue
                path = os.path.join(base_dir, name)
                with contextlib.suppress(OSError):
                    for entry in os.listdir(path):
                        os.remove(os.path.join(path, entry))
                    os.rmdir(path)


def _watch_stdin(agent: Agent) -> None:
    """The channel: EOF on stdin means the coordinator is gone or wants us to stop."""
    # os.read, not sys.stdin: a daemon thread blocked inside a buffered reader's lock makes
    # the interpreter abort at exit
    with contextlib.suppress(OSError):
        while os.read(0, 1 << 12):
            agent.renew_lease()
    agent.request_stop("channel closed")


def _read_plan_line() -> bytes:
    """The first line of stdin (the coordinator sends nothing after it but EOF)."""
    data = b""
    while b"\n" not in data:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        data += chunk
    return data.partition(b"\n")[0]


def read_node_plan(text: str) -> NodePlan:
    """The node plan as the agent uses it: attribute access over the JSON of
    :meth:`NodePlan.to_json` (the same fields; ``env`` entries are ``[key, value]`` lists)."""
    plan: NodePlan = json.loads(text, object_hook=lambda d: types.SimpleNamespace(**d))
    return plan


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if contract.PLANS_FLAG in args:  # started by pdsh, which forwards no stdin
        text = contract.decode_node_plan(args[args.index(contract.PLANS_FLAG) + 1],
                                         args[args.index(contract.HOST_FLAG) + 1])
    else:
        line = _read_plan_line()
        if not line:  # dismissed before a plan was sent (see spawn.spawn_agent)
            return 0
        text = line.decode("utf-8", "surrogateescape")
        if text.startswith(f'{{"{contract.RELAY_KEY}"'):  # a relay of the tree fan-out
            from deepshard.launcher import relay

            return relay.main(json.loads(text)[contract.RELAY_KEY], sys.stdout.buffer, Agent,
                              read_node_plan)
    node = read_node_plan(text)
    agent = Agent(node, sys.stdout.buffer)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: agent.request_stop(signal.Signals(signum).name))
    # a closed channel must not kill us with SIGPIPE before we have stopped the workers
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    threading.Thread(target=_watch_stdin, args=(agent,), daemon=True, name="channel").start()
    try:
        return agent.run()
    except BaseException:
        agent.stop_now()  # a bug in the agent must not leave its workers running
        raise


if __name__ == "__main__":
    sys.exit(main())
