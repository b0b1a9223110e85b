"""deepshard.launcher.coordinator: how a failure becomes an exit code and a message, and the
coordinator's decisions driven by scripted agents."""

from __future__ import annotations

import io
import queue
import signal
from collections.abc import Iterator

import pytest

from deepshard import contract
from deepshard.launcher.backends.base import AgentHandle, Backend
from deepshard.launcher.coordinator import Coordinator, Failure, describe_returncode
from deepshard.launcher.plan import LaunchPlan, NodePlan, WorkerPlan


def failure(returncode: int | None) -> Failure:
    return Failure(host="node-a", rank=None if returncode is None else 2,
                   returncode=returncode, reason="x")


@pytest.mark.parametrize(
    ("returncode", "exit_code"),
    [
        (3, 3),
        (1, 1),
        (255, 255),
        (-9, 128 + 9),
        (-15, 128 + 15),
        (-int(signal.SIGSEGV), 128 + int(signal.SIGSEGV)),
        (0, 1),
        (None, 1),
    ],
)
def test_exit_code(returncode, exit_code):
    assert failure(returncode).exit_code == exit_code


def test_exit_code_never_zero_for_a_failure():
    for rc in [None, *range(-64, 256)]:
        assert failure(rc).exit_code != 0


@pytest.mark.parametrize(("returncode", "text"), [(3, "exit code 3"), (0, "exit code 0"),
                                                  (1, "exit code 1")])
def test_describe_exit(returncode, text):
    assert describe_returncode(returncode) == text


@pytest.mark.parametrize(
    ("returncode", "name", "number"),
    [(-9, "SIGKILL", 9), (-15, "SIGTERM", 15), (-11, "SIGSEGV", 11), (-6, "SIGABRT", 6)],
)
def test_describe_signal(returncode, name, number):
    text = describe_returncode(returncode)
    assert name in text
    assert f"signal {number}" in text
    assert "exit code" not in text


def test_describe_sigkill_exactly():
    assert describe_returncode(-9) == "killed by SIGKILL (signal 9)"


def test_describe_unknown_signal_number():
    text = describe_returncode(-200)
    assert "200" in text
    assert text.startswith("killed by")


# -- the coordinator with scripted agents: no processes, no sockets -------------------------

class ScriptedAgent(AgentHandle):
    """Replays protocol lines; records whether it was told to stop."""

    def __init__(self, node: NodePlan, lines: list[str], hold: bool = False):
        self.node = node
        self._lines = lines
        self._hold = hold  # a silent agent: nothing after the script until stopped/killed
        self._ended: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self.stopped = self.killed = False

    def lines(self) -> Iterator[str]:
        yield from self._lines
        if self._hold and self._ended.get() and self.stopped and not self.killed:
            yield ev(contract.Done(state="stopped", reason="channel closed"))

    def stop(self) -> None:  # as a real agent: it stops its workers, says done, exits
        self.stopped = True
        self._ended.put(True)

    def wait(self, timeout: float) -> int | None:
        return 0

    def kill(self) -> None:
        self.killed = True
        self._ended.put(True)


class ScriptedBackend(Backend):
    name = "scripted"

    def __init__(self, scripts: dict[str, tuple[list[str], bool]]):
        self.scripts = scripts
        self.agents: dict[str, ScriptedAgent] = {}

    def start(self, node: NodePlan) -> AgentHandle:
        lines, hold = self.scripts[node.host]
        self.agents[node.host] = ScriptedAgent(node, lines, hold)
        return self.agents[node.host]


def plan(hosts: list[str], local: bool = True) -> LaunchPlan:
    nodes = tuple(
        NodePlan(host, i, local, "/", (), (WorkerPlan(i, 0, ("x",), ()),), stop_grace=0.1)
        for i, host in enumerate(hosts))
    return LaunchPlan("run", "127.0.0.1", 1, len(hosts), nodes)


def ev(event: contract.AgentEvent) -> str:
    return contract.format_event(event)


def coordinate(scripts, local=True, timeout=30.0):
    backend = ScriptedBackend(scripts)
    out, err = io.StringIO(), io.StringIO()
    coordinator = Coordinator(plan(list(scripts), local), backend, out=out, err=err,
                              monitor_timeout=timeout)
    return coordinator.run(), out.getvalue(), err.getvalue(), backend


def test_all_workers_succeed():
    ok = [ev(contract.Started(pids={})), contract.encode_output(0, "hi"),
          ev(contract.Exited(rank=0, returncode=0)), ev(contract.Done(state="succeeded"))]
    ok1 = [ev(contract.Exited(rank=1, returncode=0)), ev(contract.Done(state="succeeded"))]
    code, out, err, _ = coordinate({"a": (ok, False), "b": (ok1, False)})
    assert (code, out, err) == (0, "[a:0] hi\n", "")


def test_first_failure_names_rank_and_stops_everyone():
    bad = [contract.encode_output(1, "boom"), ev(contract.Exited(rank=1, returncode=-9)),
           ev(contract.Done(state="failed"))]
    code, _, err, backend = coordinate({"a": ([], True), "b": (bad, False)})
    assert code == 137
    assert "rank 1 on b failed first: killed by SIGKILL (signal 9)" in err
    assert "[b:1] boom" in err
    assert backend.agents["a"].stopped


def test_hang_report_becomes_the_failure():
    hung = [ev(contract.Hung(rank=1, silent=7.2, ranks=(1,))),
            ev(contract.Exited(rank=1, returncode=-15)), ev(contract.Done(state="failed"))]
    code, _, err, _ = coordinate({"a": ([], True), "b": (hung, False)})
    assert code == 1
    assert "rank 1 on b failed first: hung: no heartbeat for 7 s" in err


def test_agent_stopped_by_someone_else_fails_the_job():
    stopped = [ev(contract.Exited(rank=0, returncode=0)), ev(contract.Done(state="stopped",
                                                      reason="SIGTERM"))]
    code, _, err, _ = coordinate({"a": (stopped, False)})
    assert code == 1 and "the agent on a stopped its workers (SIGTERM)" in err


def test_channel_closing_without_done_is_a_lost_agent():
    code, _, err, _ = coordinate({"a": ([ev(contract.Started(pids={}))], False)})
    assert code == 1 and "lost the agent on a" in err


def test_silent_remote_agent_is_lost_and_killed():
    code, _, err, backend = coordinate({"a": ([ev(contract.Started(pids={}))], True)}, local=False,
                                       timeout=1.0)
    assert code == 1 and "no word from the agent on a" in err
    assert backend.agents["a"].killed


def test_silent_local_agent_is_not_timed_out():
    """A local pipe cannot be lost silently: only its EOF ends it (here: after 2.5 s)."""
    import threading

    backend = ScriptedBackend({"a": ([ev(contract.Started(pids={}))], True)})
    coordinator = Coordinator(plan(["a"], True), backend, out=io.StringIO(),
                              err=io.StringIO(), monitor_timeout=1.0)
    threading.Timer(2.5, lambda: backend.agents["a"].kill()).start()
    assert coordinator.run() == 1
    assert coordinator.failure is not None
    assert coordinator.failure.reason == "lost the agent on a"


def test_agent_error_is_the_failure():
    error = [ev(contract.AgentError(host="a", message="cannot start worker: No such file")),
             ev(contract.Done(state="failed"))]
    code, _, err, _ = coordinate({"a": (error, False)})
    assert code == 1 and "a failed first: cannot start worker: No such file" in err


def test_alive_events_are_not_output_and_malformed_events_are_shown():
    alive = contract.Alive(workers={0: contract.WorkerStats(step=3, beat_age=0.5)})
    lines = [ev(alive), 'e {"kind":"exited","rank":"zero"}\n',
             ev(contract.Exited(rank=0, returncode=0)), ev(contract.Done(state="succeeded"))]
    code, out, err, _ = coordinate({"a": (lines, False)})
    assert (code, err) == (0, "")
    assert out == 'e {"kind":"exited","rank":"zero"}\n'  # not protocol: echoed as it came
