"""The coordinator: runs a LaunchPlan through a backend and decides the job's outcome.

It starts one agent per node, prints worker output with ``[host:rank]`` prefixes, and
treats the first worker failure, agent error or lost agent as the failure of the job: every
agent is told to stop, and once all are gone it prints which rank failed first, how, and
the last lines it printed. SIGINT/SIGTERM/SIGHUP stop the job the same way and give 130/143/129.
It also names, in one line each, a rank that becomes or stops being a straggler
(:mod:`.straggler`).
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from deepshard import contract
from deepshard.launcher.backends.base import AgentHandle, Backend
from deepshard.launcher.plan import LaunchPlan
from deepshard.launcher.straggler import StepWatch, StragglerPolicy, Verdict

if TYPE_CHECKING:
    import io

    from deepshard.launcher.live import LiveView

TAIL_LINES = 20
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Failure:
    """The first thing that went wrong in a job."""

    host: str
    rank: int | None
    returncode: int | None
    reason: str
    lost: bool = False
    """The host itself is gone (its channel closed, it fell silent, it could not be
    started), rather than one of its workers failing."""

    @property
    def exit_code(self) -> int:
        """The worker's exit code, 128+N for a death by signal N, 1 when no worker died."""
        if self.returncode is None or self.returncode == 0:
            return 1
        return self.returncode if self.returncode > 0 else 128 - self.returncode


def describe_returncode(returncode: int) -> str:
    """``exit code 3`` or ``killed by SIGKILL (signal 9)`` for a Popen return code."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name} (signal {-returncode})"


class _Echo:
    """Worker output on its way to our stdout, on a thread of its own.

    The queue is bounded: a stdout that does not drain (``| less``, a slow terminal) holds
    back the agents, which hold back the workers, as a pipe would, while signals and
    failures are still handled at once by the coordinator's loop. A stdout that fails
    (closed, disk full, gone) stops the echo only, never the job.
    """

    def __init__(self, out: TextIO | io.TextIOBase | None, host_of: dict[int, str]):
        self.out = out
        self.host_of = host_of
        self.tails: dict[int, collections.deque[str]] = {}
        self.queue: queue.Queue[contract.Output | str | None] = queue.Queue(maxsize=4096)
        self._closed = out is None
        reconfigure = getattr(out, "reconfigure", None)  # a TextIOWrapper's, not TextIO's
        if reconfigure is not None:
            with contextlib.suppress(ValueError):
                reconfigure(errors="replace")
        self._thread = threading.Thread(target=self._run, daemon=True, name="echo")
        self._thread.start()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if isinstance(item, contract.Output):
                tail = self.tails.setdefault(item.rank, collections.deque(maxlen=TAIL_LINES))
                tail.append(item.text)
                item = f"[{self.host_of.get(item.rank, '?')}:{item.rank}] {item.text}\n"
            self._write(item)

    def _write(self, text: str) -> None:
        out = self.out
        if self._closed or out is None:
            return
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError, AttributeError):
            self._closed = True
            with contextlib.suppress(OSError, ValueError, AttributeError):
                # a broken pipe must not make the interpreter complain at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())

    def finish(self) -> None:
        """Print everything still queued, then stop."""
        self.queue.put(None)
        self._thread.join()


@dataclass(frozen=True)
class _FromAgent:
    index: int
    event: contract.AgentEvent


@dataclass(frozen=True)
class _ChannelClosed:
    index: int


@dataclass(frozen=True)
class _StopRequested:
    signum: int


@dataclass(frozen=True)
class _Regroup:
    reason: str


_Message = _FromAgent | _ChannelClosed | _StopRequested | _Regroup
"""What reaches the coordinator's loop: from the channels' threads and signal handlers."""


class Coordinator:
    """Runs one attempt of a job; :meth:`run` returns ds-run's exit code."""

    def __init__(self, plan: LaunchPlan, backend: Backend, *, out: TextIO | None = None,
                 err: TextIO | None = None, monitor_timeout: float = 30.0,
                 view: LiveView | None = None,
                 observer: Callable[[str, contract.AgentEvent], None] | None = None,
                 steps: StepWatch | None = None):
        self.plan = plan
        self.backend = backend
        self.out = sys.stdout if out is None else out
        self.err = sys.stderr if err is None else err
        self.monitor_timeout = monitor_timeout
        self.view = view
        """The live per-rank table, when ds-run's stdout is a terminal."""
        self._events: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._agents: list[AgentHandle] = []
        self._last_heard: dict[int, float] = {}
        self._echo: _Echo | None = None
        self.failure: Failure | None = None
        self.stop_signal: int | None = None
        self._stopping = False
        self._give_up_at: float | None = None
        self.observer = observer
        """Called on the coordinator's thread with (host, event) for every agent event
        (elastic training watches the checkpoints the workers report)."""
        self.lost_hosts: list[str] = []
        """Every host whose channel was lost during the attempt (before we killed any):
        a node's death makes the workers of the others fail too, often first."""
        self.regrouped: str | None = None
        """Why :meth:`regroup` stopped the attempt (``None``: it did not)."""
        self.steps = StepWatch(StragglerPolicy()) if steps is None else steps
        """The workers' step times and straggler verdicts (shared by a job's attempts)."""
        self._killed = False

    def run(self) -> int:
        host_of = {w.rank: n.host for n in self.plan.nodes for w in n.workers}
        self._echo = _Echo(self.out if self.view is None else self.view.writer(), host_of)
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            for index, node in enumerate(self.plan.nodes):
                try:
                    agent = self.backend.start(node)
                except Exception as exc:  # e.g. the SSH session could not be opened
                    self.lost_hosts.append(node.host)
                    self._fail(Failure(node.host, None, None,
                                       f"could not start the agent on {node.host}: {exc}",
                                       lost=True))
                    break
                self._agents.append(agent)
                self._last_heard[index] = time.monotonic()
                threading.Thread(target=self._pump, args=(index, agent), daemon=True,
                                 name=f"channel-{node.host}").start()
            self._loop()
        finally:
            # also on an unexpected error: never leave agents (and their workers) behind
            self._stop_all()
            self._reap_agents()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._echo.finish()
        return self._finish()

    # -- event loop ------------------------------------------------------------------------
    def _pump(self, index: int, agent: AgentHandle) -> None:
        """One agent's channel: output to the echo, events to the loop."""
        assert self._echo is not None
        for line in agent.lines():
            self._last_heard[index] = time.monotonic()
            message = contract.decode_line(line)
            if isinstance(message, contract.Output):
                self._echo.queue.put(message)
            elif message is not None:
                self._events.put(_FromAgent(index, message))
            else:  # not protocol: something on the node printed on the agent's stdout
                self._echo.queue.put(line if line.endswith("\n") else line + "\n")
        self._events.put(_ChannelClosed(index))

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._events.put(_StopRequested(signum))

    def regroup(self, reason: str) -> None:
        """Stop the attempt, not as a failure (from any thread): the job's membership
        changes and it is relaunched on other hosts."""
        self._events.put(_Regroup(reason))

    def _loop(self) -> None:
        open_channels = set(range(len(self._agents)))
        done: set[int] = set()
        next_ping = time.monotonic() + contract.ALIVE_INTERVAL
        while open_channels:
            now = time.monotonic()
            if now >= next_ping:
                for i in open_channels:
                    self._agents[i].ping()
                next_ping = now + contract.ALIVE_INTERVAL
                self._check_silence(open_channels - done, now)
            if self._give_up_at is not None and now > self._give_up_at:
                return  # stopped agents that do not close their channel get killed
            try:
                message = self._events.get(timeout=max(0.01, next_ping - now))
            except queue.Empty:
                continue
            match message:
                case _StopRequested(signum=signum):
                    self._on_stop_request(signum)
                case _Regroup(reason=reason):
                    if self.failure is None and self.regrouped is None:
                        self.regrouped = reason
                    self._stop_all()
                case _ChannelClosed(index=index):
                    open_channels.discard(index)
                    if index not in done:
                        self._on_lost(self._agents[index])
                case _FromAgent(index=index, event=event):
                    if isinstance(event, contract.Done):
                        done.add(index)
                    self._on_event(index, event)
                    if self.observer is not None:
                        self.observer(self._agents[index].node.host, event)

    def _on_lost(self, agent: AgentHandle) -> None:
        """An agent's channel closed before it said it was done."""
        why = " | ".join(agent.diagnostics()[-3:])
        host = agent.lost_with() or agent.node.host
        failure = Failure(host, None, None, f"lost the agent on {host}"
                          + (f": {why}" if why else ""), lost=True)
        if not self._killed and not (self._stopping and agent.stop_ends_channel):
            if host not in self.lost_hosts:
                self.lost_hosts.append(host)
            if self.failure is not None and not self.failure.lost and \
                    self.stop_signal is None and self.regrouped is None:
                # a node's death fails the other nodes' workers too, often before its
                # channel is seen to close: the lost node is the root cause
                self.failure = failure
        self._fail(failure)

    def _check_silence(self, watched: set[int], now: float) -> None:
        """A remote agent that has said nothing (not even ``alive``) for too long is lost;
        a local one cannot fall silent without its pipe closing, so it is never timed out.
        Once the job is stopping, silence says nothing: an agent stopping its workers (up
        to the stop grace) sends no ``alive``, and the give-up time of :meth:`_stop_all`
        ends one that never finishes; a host that dies meanwhile is found on relaunch."""
        if self._stopping:
            return
        for i in watched:
            agent = self._agents[i]
            silent = now - self._last_heard[i]
            if agent.node.local or silent <= self.monitor_timeout:
                continue
            self._last_heard[i] = now
            host = agent.lost_with() or agent.node.host
            if host not in self.lost_hosts:
                self.lost_hosts.append(host)
            self._fail(Failure(host, None, None, f"no word from the agent on {host} for "
                               f"{silent:.0f} s (host or network down?)", lost=True))
            self._killed = True  # pdsh's kill ends every host's channel
            agent.kill()  # nothing more will come; the agent stops itself (its lease)

    def _on_event(self, index: int, event: contract.AgentEvent) -> None:
        host = self._agents[index].node.host
        match event:
            case contract.Exited(rank=rank, returncode=rc):
                if self.view is not None:
                    self.view.exited(rank, rc)
                if rc != 0:
                    self._fail(Failure(host, rank, rc, describe_returncode(rc)))
            case contract.AgentError(message=message):
                self._fail(Failure(host, None, None, message))
            case contract.Hung(rank=rank, silent=silent, ranks=ranks, dumped=dumped):
                where = ("their Python stacks are in their output and logs" if dumped
                         else "no stacks: the silent process is gone")
                named = ",".join(map(str, ranks or (rank,)))
                self._fail(Failure(host, rank, None, f"hung: no heartbeat for {silent:.0f} s "
                                   f"(hung on {host}: rank(s) {named}; {where})"))
            case contract.Alive(workers=workers, gpus=gpus):
                if self.view is not None:
                    self.view.update(host, workers, gpus)
                for verdict in self.steps.observe(host, workers):
                    self._on_verdict(host, verdict)
            case contract.Done(state=state, reason=reason):
                if state not in ("succeeded", "failed"):
                    # stopped by someone else (a signal on that host, its lease running out)
                    self._fail(Failure(host, None, None, f"the agent on {host} stopped its "
                                       f"workers ({reason or state})"))
            case contract.Started():
                pass

    def _on_verdict(self, host: str, v: Verdict) -> None:
        """One line when a rank becomes, or stops being, a straggler."""
        where = f"{host}:{v.rank}"
        if v.straggler:
            self.err.write(f"ds-run: straggler: rank {v.rank} on {host} ({where}) works "
                           f"{v.ratio:.1f}x as long per step as the other ranks before it "
                           f"synchronises ({v.own:.3f} s vs {v.others:.3f} s, median of its "
                           f"last {v.steps} steps to step {v.step}); the others wait for it\n")
        else:
            self.err.write(f"ds-run: rank {v.rank} on {host} ({where}) is no longer a "
                           f"straggler ({v.ratio:.1f}x the other ranks at step {v.step})\n")
        self.err.flush()
        if self.view is not None:
            self.view.slow(v.rank, v.ratio if v.straggler else None)

    def _fail(self, failure: Failure) -> None:
        if self.failure is None and not self._stopping:
            self.failure = failure
        self._stop_all()

    def _on_stop_request(self, signum: int) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            name = signal.Signals(signum).name
            self.err.write(f"ds-run: {name} received, stopping {self.plan.world_size} "
                           f"worker(s)\n")
        self._stop_all()

    def _stop_all(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._give_up_at = time.monotonic() + self._stop_grace() + 5.0
        for agent in self._agents:
            agent.stop()

    def _stop_grace(self) -> float:
        return max((n.stop_grace for n in self.plan.nodes), default=0.0)

    def _reap_agents(self) -> None:
        """Wait for stopped agents until the give-up time of :meth:`_stop_all`, then kill."""
        deadline = self._give_up_at or time.monotonic()
        for agent in self._agents:
            if agent.wait(timeout=max(0.0, deadline - time.monotonic())) is None:
                self.err.write(f"ds-run: agent on {agent.node.host} did not exit; killing it\n")
                self._killed = True
                agent.kill()
                agent.wait(timeout=1.0)

    # -- outcome ---------------------------------------------------------------------------
    def _finish(self) -> int:
        """The exit code; the failure summary (also when a signal came after it)."""
        failure = self.failure
        if failure is None:
            return 0 if self.stop_signal is None else 128 + self.stop_signal
        assert self._echo is not None
        who = f"rank {failure.rank} on {failure.host}" if failure.rank is not None else (
            failure.host)
        self.err.write(f"ds-run: job failed: {who} failed first: {failure.reason}\n")
        tail = self._echo.tails.get(failure.rank, ()) if failure.rank is not None else ()
        if tail:
            self.err.write(f"ds-run: last {len(tail)} line(s) of rank {failure.rank}:\n")
            for text in tail:
                self.err.write(f"    [{failure.host}:{failure.rank}] {text}\n")
        elif failure.rank is not None:
            self.err.write(f"ds-run: rank {failure.rank} printed nothing\n")
        self.err.flush()
        return failure.exit_code
