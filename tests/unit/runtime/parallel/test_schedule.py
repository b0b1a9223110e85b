"""The 1F1B and forward-only schedules as data, checked action by action and run against
themselves in the rendezvous simulator (a send completes only together with its receive)."""

from __future__ import annotations

import pytest

from deepshard.runtime.parallel.schedule import (
    Backward,
    Forward,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    ScheduleDeadlock,
    ScheduleError,
    SendActivation,
    SendGrad,
    bubble_fraction,
    forward_only,
    one_f_one_b,
    simulate,
)

STAGES = range(1, 9)
MICRO_BATCHES = range(1, 17)


def all_stages(p: int, m: int):
    return [one_f_one_b(p, s, m) for s in range(p)]


def backward_twice(action) -> float:
    return {Forward: 1.0, Backward: 2.0}.get(type(action), 0.0)


def mbs(actions, kind) -> list[int]:
    return [a.mb for a in actions if type(a) is kind]


@pytest.mark.parametrize("p", STAGES)
def test_runs_without_deadlock_and_pairs_match(p):
    for m in MICRO_BATCHES:
        timeline = simulate(all_stages(p, m))  # raises on deadlock or a mismatched pair
        for s in range(p):
            assert [e.action for e in timeline.of(s)] == list(one_f_one_b(p, s, m))


@pytest.mark.parametrize("p", STAGES)
def test_each_micro_batch_once_forward_then_backward(p):
    for m in MICRO_BATCHES:
        for s, actions in enumerate(all_stages(p, m)):
            order = list(actions)
            assert mbs(order, Forward) == list(range(m))
            assert mbs(order, Backward) == list(range(m))
            for mb in range(m):
                assert order.index(Forward(mb)) < order.index(Backward(mb))
                if s > 0:
                    assert order.index(RecvActivation(mb)) < order.index(Forward(mb))
                    assert order.index(Backward(mb)) < order.index(SendGrad(mb))
                if s < p - 1:
                    assert order.index(Forward(mb)) < order.index(SendActivation(mb))
                    assert order.index(RecvGrad(mb)) < order.index(Backward(mb))
                if s in (0, p - 1):
                    assert order.index(LoadMicroBatch(mb)) < order.index(Forward(mb))
            assert order[-3:] == [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


@pytest.mark.parametrize("p", STAGES)
def test_action_counts(p):
    for m in MICRO_BATCHES:
        for s, actions in enumerate(all_stages(p, m)):
            count = {kind: len(mbs(actions, kind)) for kind in
                     (LoadMicroBatch, RecvActivation, SendActivation, RecvGrad, SendGrad)}
            assert count[LoadMicroBatch] == (m if s in (0, p - 1) else 0)
            assert count[RecvActivation] == count[SendGrad] == (m if s > 0 else 0)
            assert count[SendActivation] == count[RecvGrad] == (m if s < p - 1 else 0)
            assert len(actions) == 2 * m + sum(count.values()) + 3


@pytest.mark.parametrize("p", STAGES)
def test_sends_match_receives_in_order(p):
    for m in MICRO_BATCHES:
        stages = all_stages(p, m)
        for s in range(p - 1):
            assert mbs(stages[s], SendActivation) == mbs(stages[s + 1], RecvActivation)
            assert mbs(stages[s + 1], SendGrad) == mbs(stages[s], RecvGrad)


@pytest.mark.parametrize("p", STAGES)
def test_warmup_and_in_flight_bound(p):
    for m in MICRO_BATCHES:
        for s, actions in enumerate(all_stages(p, m)):
            computes = [a for a in actions if type(a) in (Forward, Backward)]
            warmup = min(p - s - 1, m)
            assert all(type(a) is Forward for a in computes[:warmup])
            assert type(computes[warmup]) is Forward or warmup == m
            alive = peak = 0
            for a in computes:
                alive += 1 if type(a) is Forward else -1
                peak = max(peak, alive)
            assert peak == min(p - s, m)  # activations kept at once


def test_steady_state_order_for_a_middle_stage():
    actions = one_f_one_b(stages=3, stage=1, micro_batches=3)
    assert list(actions[:9]) == [
        RecvActivation(0), Forward(0), SendActivation(0),  # warm-up
        RecvActivation(1), Forward(1), SendActivation(1),
        RecvGrad(0), Backward(0), RecvActivation(2),  # next input before the grad
    ]


@pytest.mark.parametrize("p", STAGES)
def test_bubble_matches_theory(p):
    for m in MICRO_BATCHES:
        assert bubble_fraction(p, m) == (p - 1) / (m + p - 1)
        equal = simulate(all_stages(p, m))
        assert equal.makespan == 2 * (m + p - 1)
        assert all(equal.bubble(s) == pytest.approx(bubble_fraction(p, m)) for s in range(p))
        # backward twice as long as forward: the same bubble share
        slow = simulate(all_stages(p, m), cost=backward_twice)
        assert slow.makespan == 3 * (m + p - 1)
        assert slow.bubble(0) == pytest.approx(bubble_fraction(p, m))


def test_sending_the_grad_first_deadlocks():
    """The order the schedule avoids: SendGrad before the next RecvActivation."""

    def grad_first(actions):
        out = list(actions)
        for i in range(len(out) - 1):
            if type(out[i]) is RecvActivation and type(out[i + 1]) is SendGrad:
                out[i], out[i + 1] = out[i + 1], out[i]
        return out

    with pytest.raises(ScheduleDeadlock, match=r"SendActivation.*SendGrad"):
        simulate([grad_first(a) for a in all_stages(4, 6)])


def test_simulator_catches_broken_schedules():
    with pytest.raises(ScheduleDeadlock, match="stage 1 waits in RecvActivation"):
        simulate([[Forward(0)], [RecvActivation(0), Forward(0)]])
    with pytest.raises(ScheduleError, match="one micro-batch's data into another"):
        simulate([[SendActivation(0)], [RecvActivation(1)]])
    with pytest.raises(ScheduleError, match="no stage 1"):
        simulate([[SendActivation(0)]])


def test_bad_arguments():
    with pytest.raises(ValueError, match="stage 2 outside"):
        one_f_one_b(2, 2, 4)
    with pytest.raises(ValueError, match="micro_batches >= 1"):
        one_f_one_b(2, 0, 0)
    with pytest.raises(ValueError):
        bubble_fraction(0, 1)


def test_example_four_stages_six_micro_batches():
    first = one_f_one_b(4, 0, 6)
    assert [type(a).__name__ + str(getattr(a, "mb", "")) for a in first[:12]] == [
        "LoadMicroBatch0", "Forward0", "SendActivation0",
        "LoadMicroBatch1", "Forward1", "SendActivation1",
        "LoadMicroBatch2", "Forward2", "SendActivation2",
        "LoadMicroBatch3", "Forward3", "SendActivation3",
    ]
    last = one_f_one_b(4, 3, 6)
    assert list(last[:7]) == [LoadMicroBatch(0), RecvActivation(0), Forward(0), Backward(0),
                              LoadMicroBatch(1), RecvActivation(1), SendGrad(0)]


# The forward-only (evaluation) schedule -------------------------------------------------


def eval_stages(p: int, m: int):
    return [forward_only(p, s, m) for s in range(p)]


@pytest.mark.parametrize("p", STAGES)
def test_forward_only_runs_without_deadlock(p):
    for m in MICRO_BATCHES:
        timeline = simulate(eval_stages(p, m))  # raises on deadlock or a mismatched pair
        for s in range(p):
            assert [e.action for e in timeline.of(s)] == list(forward_only(p, s, m))
        # pipelined: stage s forwards micro-batch mb at time mb + s
        assert timeline.makespan == m + p - 1
        starts = {(e.stage, e.action.mb): e.start for e in timeline.events
                  if type(e.action) is Forward}
        assert starts == {(s, mb): float(mb + s) for s in range(p) for mb in range(m)}


@pytest.mark.parametrize("p", STAGES)
def test_forward_only_forwards_each_micro_batch_once_and_nothing_else(p):
    for m in MICRO_BATCHES:
        stages = eval_stages(p, m)
        for s, actions in enumerate(stages):
            order = list(actions)
            assert mbs(order, Forward) == list(range(m))
            assert {type(a) for a in order} <= {LoadMicroBatch, RecvActivation, Forward,
                                                SendActivation}
            assert mbs(order, LoadMicroBatch) == (list(range(m)) if s in (0, p - 1) else [])
            assert mbs(order, RecvActivation) == (list(range(m)) if s > 0 else [])
            assert mbs(order, SendActivation) == (list(range(m)) if s < p - 1 else [])
            for mb in range(m):
                if s in (0, p - 1):
                    assert order.index(LoadMicroBatch(mb)) < order.index(Forward(mb))
                if s > 0:
                    assert order.index(RecvActivation(mb)) < order.index(Forward(mb))
                if s < p - 1:
                    assert order.index(Forward(mb)) < order.index(SendActivation(mb))
        for s in range(p - 1):  # each link: the same micro-batches, in the same order
            assert mbs(stages[s], SendActivation) == mbs(stages[s + 1], RecvActivation)


def test_forward_only_example_middle_stage():
    assert list(forward_only(stages=3, stage=1, micro_batches=2)) == [
        RecvActivation(0), Forward(0), SendActivation(0),
        RecvActivation(1), Forward(1), SendActivation(1)]
    assert list(forward_only(stages=1, stage=0, micro_batches=2)) == [
        LoadMicroBatch(0), Forward(0), LoadMicroBatch(1), Forward(1)]


def test_forward_only_bad_arguments():
    with pytest.raises(ValueError, match="stage 3 outside"):
        forward_only(3, 3, 1)
    with pytest.raises(ValueError, match="micro_batches >= 1"):
        forward_only(2, 0, 0)


def test_forward_only_interleaves_with_training_batches():
    """Evaluation between two training batches: each stage runs the concatenation of its
    lists, and the pipeline still pairs every send with its receive."""
    for p in (2, 3, 4):
        lists = [one_f_one_b(p, s, 4) + forward_only(p, s, 3) + one_f_one_b(p, s, 4)
                 for s in range(p)]
        simulate(lists)  # raises on deadlock or a mismatched pair
