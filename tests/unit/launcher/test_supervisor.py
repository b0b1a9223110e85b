"""The restart policy and the coordinator's decisions, driven by scripted inputs: no
processes, no sockets (torch elastic's agent tests are the model)."""

from __future__ import annotations

import io
import queue
from collections.abc import Iterator

from deepshard import contract
from deepshard.launcher.backends.base import AgentHandle, Backend
from deepshard.launcher.coordinator import Coordinator
from deepshard.launcher.plan import LaunchPlan, NodePlan, WorkerPlan
from deepshard.launcher.supervisor import Outcome, backoff, supervise


def run_policy(outcomes: list[Outcome], max_restarts: int) -> tuple[int, list[int], str]:
    calls: list[int] = []
    sleeps: list[float] = []
    err = io.StringIO()

    def attempt(restart: int) -> Outcome:
        calls.append(restart)
        return outcomes[len(calls) - 1]

    code = supervise(attempt, max_restarts, err=err, sleep=sleeps.append)
    assert sleeps == [backoff(k) for k in range(len(calls) - 1)]
    return code, calls, err.getvalue()


def test_success_needs_no_restart():
    assert run_policy([Outcome(0, False)], 3)[:2] == (0, [0])


def test_failures_are_restarted_until_one_succeeds():
    code, calls, err = run_policy([Outcome(137, True), Outcome(1, True), Outcome(0, False)], 3)
    assert (code, calls) == (0, [0, 1, 2])
    assert "restart 1 of 3" in err and "restart 2 of 3" in err


def test_restarts_run_out_and_the_last_code_is_returned():
    code, calls, err = run_policy([Outcome(137, True)] * 3, 2)
    assert (code, calls) == (137, [0, 1, 2])
    assert "giving up after 2 restart(s)" in err


def test_a_stop_the_user_asked_for_is_never_restarted():
    assert run_policy([Outcome(130, False)], 5)[:2] == (130, [0])


def test_no_restarts_by_default():
    code, calls, err = run_policy([Outcome(3, True)], 0)
    assert (code, calls, err) == (3, [0], "")


def test_backoff_grows_and_is_capped():
    assert [backoff(k) for k in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]


# -- the coordinator with scripted agents ----------------------------------------------------

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
            yield ev("done", state="stopped", reason="channel closed")

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


def ev(kind: str, **fields: object) -> str:
    return contract.encode_event(kind, **fields)


def coordinate(scripts, local=True, timeout=30.0):
    backend = ScriptedBackend(scripts)
    out, err = io.StringIO(), io.StringIO()
    coordinator = Coordinator(plan(list(scripts), local), backend, out=out, err=err,
                              monitor_timeout=timeout)
    return coordinator.run(), out.getvalue(), err.getvalue(), backend


def test_all_workers_succeed():
    ok = [ev("started", pids={}), contract.encode_output(0, "hi"),
          ev("exited", rank=0, returncode=0), ev("done", state="succeeded")]
    ok1 = [ev("exited", rank=1, returncode=0), ev("done", state="succeeded")]
    code, out, err, _ = coordinate({"a": (ok, False), "b": (ok1, False)})
    assert (code, out, err) == (0, "[a:0] hi\n", "")


def test_first_failure_names_rank_and_stops_everyone():
    bad = [contract.encode_output(1, "boom"), ev("exited", rank=1, returncode=-9),
           ev("done", state="failed")]
    code, _, err, backend = coordinate({"a": ([], True), "b": (bad, False)})
    assert code == 137
    assert "rank 1 on b failed first: killed by SIGKILL (signal 9)" in err
    assert "[b:1] boom" in err
    assert backend.agents["a"].stopped


def test_hang_report_becomes_the_failure():
    hung = [ev("hung", rank=1, silent=7.2, ranks=[1]), ev("exited", rank=1, returncode=-15),
            ev("done", state="failed")]
    code, _, err, _ = coordinate({"a": ([], True), "b": (hung, False)})
    assert code == 1
    assert "rank 1 on b failed first: hung: no heartbeat for 7 s" in err


def test_agent_stopped_by_someone_else_fails_the_job():
    stopped = [ev("exited", rank=0, returncode=0), ev("done", state="stopped",
                                                      reason="SIGTERM")]
    code, _, err, _ = coordinate({"a": (stopped, False)})
    assert code == 1 and "the agent on a stopped its workers (SIGTERM)" in err


def test_channel_closing_without_done_is_a_lost_agent():
    code, _, err, _ = coordinate({"a": ([ev("started", pids={})], False)})
    assert code == 1 and "lost the agent on a" in err


def test_silent_remote_agent_is_lost_and_killed():
    code, _, err, backend = coordinate({"a": ([ev("started", pids={})], True)}, local=False,
                                       timeout=1.0)
    assert code == 1 and "no word from the agent on a" in err
    assert backend.agents["a"].killed


def test_silent_local_agent_is_not_timed_out():
    """A local pipe cannot be lost silently: only its EOF ends it (here: after 2.5 s)."""
    import threading

    backend = ScriptedBackend({"a": ([ev("started", pids={})], True)})
    coordinator = Coordinator(plan(["a"], True), backend, out=io.StringIO(),
                              err=io.StringIO(), monitor_timeout=1.0)
    threading.Timer(2.5, lambda: backend.agents["a"].kill()).start()
    assert coordinator.run() == 1
    assert coordinator.failure is not None
    assert coordinator.failure.reason == "lost the agent on a"
