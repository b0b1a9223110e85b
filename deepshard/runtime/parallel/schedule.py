"""The pipeline schedules as data, and a simulator that proves they cannot deadlock.

:func:`one_f_one_b` gives, for one stage, the list of actions that stage executes for one
training batch of ``m`` micro-batches, in order: warm-up forwards, the steady state of
one forward then one backward, cool-down backwards, then the gradient reductions and the
optimizer step. :func:`forward_only` gives the evaluation counterpart (DeepSpeed's
``InferenceSchedule``): each micro-batch in turn received, forwarded and sent on, with no
backward and no step. Nothing here touches torch; an executor walks the list and performs
each action (see the action classes for what each one means).

Communication is point-to-point between neighbouring stages only, stage-relative:
``SendActivation``/``RecvGrad`` talk to ``stage + 1``, ``RecvActivation``/``SendGrad`` to
``stage - 1``. Over each link the activations travel in micro-batch order, and so do the
gradients.

Why it cannot deadlock, even when every send blocks until its receive is posted (the
strictest semantics; NCCL's and gloo's are looser). In the steady state two neighbours
``s`` and ``s + 1`` exchange one activation (``s`` -> ``s + 1``) and one gradient
(``s + 1`` -> ``s``) per step. Both sending first would block both, so every stage
orders each exchange the same way, **activation first, then gradient**:

* after ``Forward(f)``: ``SendActivation(f)`` then ``RecvGrad(b)``;
* after ``Backward(b)``: ``RecvActivation(f + 1)`` (the next forward's input) then
  ``SendGrad(b)``.

Seen from the link, ``s`` does send-act, recv-grad and ``s + 1`` does recv-act,
send-grad: the two halves pair up in the same order. :func:`simulate` runs all stages'
lists against each other under rendezvous semantics and raises on a deadlock or a
mismatched pair; the tests run it for every ``P <= 8``, ``m <= 16``.

The forward-only schedule carries activations only, each link in micro-batch order: a
stage waits only on its predecessor, so the wait-for relation has no cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "Action", "Backward", "Event", "Forward", "LoadMicroBatch", "MicroBatchAction",
    "OptimizerStep",
    "RecvActivation", "RecvGrad", "ReduceGrads", "ReduceTiedGrads", "ScheduleDeadlock",
    "ScheduleError", "SendActivation", "SendGrad", "Timeline", "bubble_fraction",
    "forward_only", "one_f_one_b", "simulate",
]


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule."""


@dataclass(frozen=True)
class MicroBatchAction(Action):
    """An action on one micro-batch, numbered ``0 .. m - 1`` within the batch."""

    mb: int


@dataclass(frozen=True)
class LoadMicroBatch(MicroBatchAction):
    """Take micro-batch ``mb`` from the data iterator: the first stage uses its inputs,
    the last stage its labels (a single stage, both)."""


@dataclass(frozen=True)
class RecvActivation(MicroBatchAction):
    """Receive ``mb``'s input activation from ``stage - 1`` (in training, make it a leaf
    that requires grad, so that backward yields the gradient to send back)."""


@dataclass(frozen=True)
class Forward(MicroBatchAction):
    """Run this stage's layers on ``mb``'s input; the last stage also applies the loss
    function (in training scaled by ``1 / m`` and kept for backward)."""


@dataclass(frozen=True)
class SendActivation(MicroBatchAction):
    """Send ``mb``'s output activation to ``stage + 1`` (detached; keep the graph)."""


@dataclass(frozen=True)
class RecvGrad(MicroBatchAction):
    """Receive the gradient of ``mb``'s output activation from ``stage + 1``."""


@dataclass(frozen=True)
class Backward(MicroBatchAction):
    """Back-propagate ``mb``: from the loss on the last stage, else from the output with
    the received gradient. Parameter gradients accumulate; free ``mb``'s buffers after."""


@dataclass(frozen=True)
class SendGrad(MicroBatchAction):
    """Send the gradient of ``mb``'s input activation to ``stage - 1``."""


@dataclass(frozen=True)
class ReduceTiedGrads(Action):
    """All-reduce (sum) the gradients of tied weights over the stages that share them."""


@dataclass(frozen=True)
class ReduceGrads(Action):
    """Reduce the accumulated gradients over the data-parallel group."""


@dataclass(frozen=True)
class OptimizerStep(Action):
    """Step the optimizer (and LR scheduler); zero the gradients."""


# The peer of each communication action (stage offset) and the action it pairs with.
_PEER: Mapping[type[Action], tuple[int, type[Action]]] = MappingProxyType({
    SendActivation: (+1, RecvActivation),
    RecvActivation: (-1, SendActivation),
    RecvGrad: (+1, SendGrad),
    SendGrad: (-1, RecvGrad),
})


def _check_counts(stages: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"need stages >= 1 and micro_batches >= 1, got {stages}, "
                         f"{micro_batches}")


def _check_stage(stages: int, stage: int, micro_batches: int) -> None:
    _check_counts(stages, micro_batches)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} outside 0..{stages - 1}")


def one_f_one_b(stages: int, stage: int, micro_batches: int) -> tuple[Action, ...]:
    """The actions ``stage`` (of ``stages``) executes to train one batch of
    ``micro_batches``, in order (non-interleaved 1F1B, as in PipeDream-Flush/Megatron).

    Stage ``s`` first runs ``min(P - s - 1, m)`` warm-up forwards, then alternates one
    forward and one backward, then runs the remaining backwards; at most ``P - s``
    micro-batches' activations are alive on it at any time. Ends with
    :class:`ReduceTiedGrads`, :class:`ReduceGrads`, :class:`OptimizerStep` on every stage.
    """
    _check_stage(stages, stage, micro_batches)
    first, last = stage == 0, stage == stages - 1
    warmup = min(stages - stage - 1, micro_batches)
    actions: list[Action] = []

    def take_input(mb: int) -> None:
        if first or last:
            actions.append(LoadMicroBatch(mb))
        if not first:
            actions.append(RecvActivation(mb))

    def forward(mb: int) -> None:
        actions.append(Forward(mb))
        if not last:
            actions.append(SendActivation(mb))

    def backward(mb: int, next_forward: int | None) -> None:
        if not last:
            actions.append(RecvGrad(mb))
        actions.append(Backward(mb))
        if next_forward is not None:  # activation before gradient on the link to stage - 1
            take_input(next_forward)
        if not first:
            actions.append(SendGrad(mb))

    for mb in range(warmup):
        take_input(mb)
        forward(mb)
    if warmup < micro_batches:
        take_input(warmup)
    for b in range(micro_batches):
        f = warmup + b
        if f < micro_batches:
            forward(f)
        backward(b, f + 1 if f + 1 < micro_batches else None)
    actions += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
    return tuple(actions)


def forward_only(stages: int, stage: int, micro_batches: int) -> tuple[Action, ...]:
    """The actions ``stage`` (of ``stages``) executes to evaluate one batch of
    ``micro_batches``, in order: for each micro-batch, load it (first and last stage),
    receive its input from ``stage - 1`` (all but the first), forward it, send the output
    to ``stage + 1`` (all but the last). No backward, no reduction, no step.

    With every forward taking one unit, the batch takes ``m + P - 1`` units: stage ``s``
    forwards micro-batch ``mb`` at time ``mb + s``, while its predecessor is already on
    ``mb + 1``.
    """
    _check_stage(stages, stage, micro_batches)
    first, last = stage == 0, stage == stages - 1
    actions: list[Action] = []
    for mb in range(micro_batches):
        if first or last:
            actions.append(LoadMicroBatch(mb))
        if not first:
            actions.append(RecvActivation(mb))
        actions.append(Forward(mb))
        if not last:
            actions.append(SendActivation(mb))
    return tuple(actions)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a stage's time in one 1F1B batch, ``(P - 1) / (m + P - 1)``, when
    every stage's forward and backward take the same time and communication is free."""
    _check_counts(stages, micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


class ScheduleError(Exception):
    """Stages' schedules that do not fit together (a pair of mismatched actions)."""


class ScheduleDeadlock(ScheduleError):
    """Every unfinished stage waits on a peer that waits on something else."""


@dataclass(frozen=True)
class Event:
    """One executed action: which stage ran it, and when."""

    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` found: every event, by start time then stage."""

    events: tuple[Event, ...]
    stages: int

    @property
    def makespan(self) -> float:
        """When the last action ends."""
        return max((e.end for e in self.events), default=0.0)

    def busy(self, stage: int) -> float:
        """Time ``stage`` spent in :class:`Forward` and :class:`Backward`."""
        return sum(e.end - e.start for e in self.events
                   if e.stage == stage and isinstance(e.action, (Forward, Backward)))

    def bubble(self, stage: int) -> float:
        """Share of the makespan ``stage`` spent not computing."""
        return 1.0 - self.busy(stage) / self.makespan if self.makespan else 0.0

    def of(self, stage: int) -> tuple[Event, ...]:
        """``stage``'s events, in execution order."""
        return tuple(e for e in self.events if e.stage == stage)


DEFAULT_COST: Mapping[type[Action], float] = MappingProxyType({Forward: 1.0, Backward: 1.0})


def simulate(schedules: Sequence[Sequence[Action]],
             cost: Callable[[Action], float] | None = None) -> Timeline:
    """Run every stage's schedule (index = stage) against the others.

    Each stage runs its actions in order. Communication is rendezvous: a send and the
    matching receive on the neighbour (``SendActivation(mb)`` on ``s`` with
    ``RecvActivation(mb)`` on ``s + 1``, ``SendGrad(mb)`` on ``s`` with ``RecvGrad(mb)``
    on ``s - 1``) complete together, once both stages have reached them. ``cost`` gives
    each action's duration (default: 1 for forward and backward, 0 for the rest).

    Raises :class:`ScheduleDeadlock` when no stage can move and some are unfinished,
    :class:`ScheduleError` when a stage talks to a stage that does not exist or a pair
    meets with different micro-batches or directions.
    """
    duration = cost or (lambda a: DEFAULT_COST.get(type(a), 0.0))
    n = len(schedules)
    pos = [0] * n
    clock = [0.0] * n
    events: list[Event] = []

    def current(s: int) -> Action | None:
        return schedules[s][pos[s]] if pos[s] < len(schedules[s]) else None

    def run(s: int, action: Action, start: float) -> None:
        end = start + duration(action)
        events.append(Event(s, action, start, end))
        clock[s], pos[s] = end, pos[s] + 1

    progress = True
    while progress:
        progress = False
        for s in range(n):
            action = current(s)
            if action is None:
                continue
            if type(action) not in _PEER:
                run(s, action, clock[s])
                progress = True
                continue
            offset, partner_type = _PEER[type(action)]
            peer = s + offset
            if not 0 <= peer < n:
                raise ScheduleError(f"stage {s} runs {action} but there is no stage {peer}")
            other = current(peer)
            if other is None or type(other) not in _PEER or _PEER[type(other)][0] != -offset:
                continue  # the peer is busy or talking to its other neighbour: wait
            if type(other) is not partner_type:  # both send, or both receive: neither returns
                raise ScheduleDeadlock(f"deadlock: stage {s} runs {action} while stage {peer} "
                                       f"runs {other}")
            if other.mb != action.mb:  # type: ignore[attr-defined]
                raise ScheduleError(f"stage {s} runs {action} while stage {peer} runs {other}: "
                                    "the pair would carry one micro-batch's data into another")
            start = max(clock[s], clock[peer])
            run(s, action, start)
            run(peer, other, start)
            progress = True
    stuck = [s for s in range(n) if current(s) is not None]
    if stuck:
        waits = "; ".join(f"stage {s} waits in {current(s)}" for s in stuck)
        raise ScheduleDeadlock(f"deadlock: {waits}")
    events.sort(key=lambda e: (e.start, e.stage))  # stable: each stage keeps its order
    return Timeline(tuple(events), n)
