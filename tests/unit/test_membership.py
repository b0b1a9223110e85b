"""The elastic membership policy over scripted events: no process, no network."""

from __future__ import annotations

from deepshard.launcher.membership import (
    CheckpointComplete,
    Failed,
    Keep,
    Lost,
    Membership,
    Policy,
    ProbeOk,
    Relaunch,
    Stop,
    begin,
    on_event,
)

HOSTS = ("a", "b", "c")


def policy(**kw) -> Policy:
    return Policy(hosts=kw.pop("hosts", HOSTS), slots=kw.pop("slots", (1, 1, 1)), **kw)


def play(state: Membership, *events):
    decisions = []
    for event in events:
        state, decision = on_event(state, event)
        decisions.append(decision)
    return state, decisions


def test_lost_host_shrinks_and_returns_at_the_next_checkpoint():
    state, first = begin(policy(min_nodes=2, checkpoints=True))
    assert first == Relaunch(HOSTS, after_failure=False)
    state, (shrink, wait, other, grow, after) = play(
        state, Lost("b", "channel closed"), ProbeOk("b"), ProbeOk("a"),
        CheckpointComplete(7), CheckpointComplete(8))
    assert shrink == Relaunch(("a", "c"), ("b left (lost: channel closed); world size 2 on "
                                           "a,c",), after_failure=False)
    assert wait == Keep() and other == Keep()  # back, but growing waits for a checkpoint
    assert grow == Relaunch(HOSTS, ("b joined (checkpoint of step 7 complete); world size 3 "
                                    "on a,b,c",), after_failure=False)
    assert after == Keep()
    assert state.active == HOSTS and state.excluded == ()


def test_without_checkpoints_a_returning_host_joins_at_once():
    state, _ = begin(policy())
    state, (_, grow) = play(state, Lost("c", "silent"), ProbeOk("c"))
    assert grow == Relaunch(HOSTS, ("c joined (c is back); world size 3 on a,b,c",),
                            after_failure=False)


def test_a_reported_checkpoint_makes_growth_wait():
    state, _ = begin(policy())
    state, decisions = play(state, CheckpointComplete(1), Lost("a", "x"), ProbeOk("a"))
    assert decisions[-1] == Keep() and state.grow_pending
    assert state.active == ("b", "c")  # ranks stay host-major over the current hosts


def test_failing_twice_in_a_row_excludes_and_stays_out():
    state, _ = begin(policy())
    state, (again, out, probe) = play(state, Failed("c", "exit code 3"),
                                      Failed("c", "exit code 3"), ProbeOk("c"))
    assert again == Relaunch(HOSTS)  # once: a plain restart on the same hosts
    assert out == Relaunch(("a", "b"), ("c left (its workers failed twice in a row: exit "
                                        "code 3); world size 2 on a,b",), after_failure=False)
    assert probe == Keep() and state.active == ("a", "b")


def test_failures_of_different_hosts_are_not_in_a_row():
    state, _ = begin(policy())
    state, decisions = play(state, Failed("c", "x"), Failed("b", "x"), Failed("c", "x"))
    assert decisions == [Relaunch(HOSTS)] * 3
    assert state.failures == ("c", 1)


def test_below_the_minimum_stops_with_the_reason():
    state, _ = begin(policy(min_nodes=2))
    state, (shrink, stop) = play(state, Lost("a", "gone"), Lost("c", "silent for 5 s"))
    assert isinstance(shrink, Relaunch) and shrink.hosts == ("b", "c")
    assert stop == Stop("c left (lost: silent for 5 s); 1 usable host(s) now, fewer than "
                        "--min_elastic_nodes 2: giving up")


def test_max_nodes_and_world_sizes_choose_a_prefix():
    state, first = begin(policy(hosts=("a", "b", "c", "d"), slots=(2, 2, 1, 1),
                                world_sizes=frozenset({2, 4, 6}), max_nodes=3))
    assert first.hosts == ("a", "b")  # a,b,c is 5 ranks: not allowed
    state, (shrink,) = play(state, Lost("a", "x"))
    assert shrink == Relaunch(("b", "c", "d"), ("a left (lost: x); world size 4 on b,c,d",),
                              after_failure=False)


def test_no_allowed_world_size_at_the_start():
    _, decision = begin(policy(world_sizes=frozenset({5})))
    assert isinstance(decision, Stop) and "allowed world size (5)" in decision.reason


# -- what the elastic driver is told is lost: the coordinator's lost_hosts ---------------------

def test_an_agent_slow_to_stop_is_not_a_lost_host():
    """One host's channel closes (lost); the others take longer than --monitor_timeout to
    stop their workers (an agent sends no ``alive`` meanwhile): only the first is lost."""
    import io
    import threading

    from deepshard import contract
    from deepshard.launcher.coordinator import Coordinator
    from tests.unit.launcher.test_coordinator import ScriptedAgent, ScriptedBackend, ev, plan

    class SlowToStop(ScriptedAgent):
        def stop(self) -> None:
            self.stopped = True
            threading.Timer(1.5, self._ended.put, args=(True,)).start()

    class Backend(ScriptedBackend):
        def start(self, node):
            lines, hold = self.scripts[node.host]
            kind = SlowToStop if hold else ScriptedAgent
            self.agents[node.host] = kind(node, lines, hold)
            return self.agents[node.host]

    started = [ev(contract.Started(pids={}))]
    backend = Backend({"a": (started, True), "b": (started, False), "c": (started, True)})
    coordinator = Coordinator(plan(["a", "b", "c"], local=False), backend, out=io.StringIO(),
                              err=io.StringIO(), monitor_timeout=0.5)
    assert coordinator.run() == 1
    assert coordinator.lost_hosts == ["b"]
    assert coordinator.failure is not None and coordinator.failure.reason == "lost the agent on b"
    assert not backend.agents["a"].killed and not backend.agents["c"].killed
