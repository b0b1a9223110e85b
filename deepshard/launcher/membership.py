"""The elastic membership policy: which hosts the job runs on, after each thing that happens.

A pure state machine beside the restart policy (:mod:`.supervisor`): :func:`begin` gives
the first :class:`Membership` and :func:`on_event` maps a membership and an event to the
next membership and a decision, so it is unit-tested with scripted events and no process.

Events: a host :class:`Lost` (its channel dropped, it fell silent past
``--monitor_timeout``, or it could not be reached on relaunch), a host's workers
:class:`Failed`, an excluded host's :class:`ProbeOk`, a :class:`CheckpointComplete`.

Rules:

- a lost host is excluded at once; a host whose workers fail in two attempts in a row is
  excluded too (a single failure relaunches the same hosts, as a plain restart);
- the job runs on the first hosts (in hostfile order, so ranks stay host-major) of those
  not excluded, at most ``max_nodes`` of them, dropping hosts from the end until the world
  size is one the job allows (the ``elasticity`` section, or a train batch that a fixed
  micro batch must split evenly); fewer than ``min_nodes`` ends the job;
- a lost host that probes ok again is back; when that makes the job larger, it grows, at
  once or, when checkpoints are being written, at the next complete one (no step lost);
- a host excluded for failing workers stays out: a probe cannot tell that its workers
  would not fail again.

Every change of membership is one line of :attr:`Relaunch.changes` / :attr:`Stop.reason`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Lost:
    """The host is gone: its channel closed, it fell silent, or it cannot be reached."""

    host: str
    reason: str


@dataclass(frozen=True)
class Failed:
    """A worker of the host failed first (an exit, a hang, an agent error)."""

    host: str
    reason: str


@dataclass(frozen=True)
class ProbeOk:
    """An excluded host is reachable again and passes the preflight checks."""

    host: str


@dataclass(frozen=True)
class CheckpointComplete:
    """The running job finished writing a complete checkpoint of ``step``."""

    step: int


Event = Lost | Failed | ProbeOk | CheckpointComplete


@dataclass(frozen=True)
class Keep:
    """Nothing to do: the current attempt runs on (or, after an attempt, nothing ended
    it that calls for a relaunch)."""


@dataclass(frozen=True)
class Relaunch:
    """Stop the current attempt (if one runs) and start the job on ``hosts``."""

    hosts: tuple[str, ...]
    changes: tuple[str, ...] = ()
    """One line per change of membership (empty: the same hosts again)."""
    after_failure: bool = True
    """Whether a failure caused it without changing the hosts (counted against
    ``--max_restarts``); a shrink or a growth is not."""


@dataclass(frozen=True)
class Stop:
    """The job cannot go on: fewer than ``min_nodes`` usable hosts."""

    reason: str


Decision = Keep | Relaunch | Stop


@dataclass(frozen=True, kw_only=True)
class Policy:
    """The fixed inputs: every host the job may use (hostfile order) and its slots."""

    hosts: tuple[str, ...]
    slots: tuple[int, ...]
    """Workers per host, in the order of :attr:`hosts`."""
    min_nodes: int = 1
    max_nodes: int | None = None
    """At most this many nodes at once (``None``: all of :attr:`hosts`)."""
    world_sizes: frozenset[int] | None = None
    """The world sizes the job may run at (``None``: any)."""
    checkpoints: bool = False
    """Whether checkpoints are configured: growth then waits for the next complete one."""

    def world(self, hosts: tuple[str, ...]) -> int:
        slots = dict(zip(self.hosts, self.slots, strict=True))
        return sum(slots[h] for h in hosts)


@dataclass(frozen=True)
class Membership:
    """Where the job stands: the hosts it runs on, those out and why."""

    policy: Policy
    active: tuple[str, ...]
    excluded: tuple[tuple[str, str], ...] = ()
    """(host, why) of every excluded host, in the order they left."""
    failures: tuple[str, int] = ("", 0)
    """The host whose workers failed in the latest attempts, and in how many in a row."""
    grow_pending: bool = False
    """A host is back and the job waits for a complete checkpoint to grow."""
    checkpointed: bool = False
    """A checkpoint was reported in this run (so one is configured)."""

    @property
    def world_size(self) -> int:
        return self.policy.world(self.active)

    def is_excluded(self, host: str) -> bool:
        return any(h == host for h, _ in self.excluded)


def choose(policy: Policy, out: set[str]) -> tuple[str, ...] | None:
    """The hosts to run on when ``out`` are excluded; ``None`` below ``min_nodes``."""
    usable = [h for h in policy.hosts if h not in out][:policy.max_nodes]
    while len(usable) >= policy.min_nodes and usable:
        chosen = tuple(usable)
        if policy.world_sizes is None or policy.world(chosen) in policy.world_sizes:
            return chosen
        usable.pop()
    return None


def begin(policy: Policy) -> tuple[Membership, Decision]:
    """The first membership: the first launch, or :class:`Stop` when no host set fits."""
    chosen = choose(policy, set())
    if chosen is None:
        return Membership(policy, ()), Stop(_too_few(policy, set(), "at the start"))
    return Membership(policy, chosen), Relaunch(chosen, after_failure=False)


def on_event(state: Membership, event: Event) -> tuple[Membership, Decision]:
    """The next membership and what to do (see the module docstring for the rules)."""
    match event:
        case Lost(host=host, reason=reason):
            return _exclude(state, host, f"lost: {reason}")
        case Failed(host=host, reason=reason):
            last, count = state.failures
            count = count + 1 if last == host else 1
            if count >= 2:
                state = dataclasses.replace(state, failures=("", 0))
                return _exclude(state, host, f"its workers failed twice in a row: {reason}")
            state = dataclasses.replace(state, failures=(host, count))
            return state, Relaunch(state.active)
        case ProbeOk(host=host):
            why = dict(state.excluded).get(host)
            if why is None or not why.startswith("lost"):
                return state, Keep()  # not out, or out for failing workers: stays out
            state = dataclasses.replace(
                state, excluded=tuple(e for e in state.excluded if e[0] != host))
            if state.policy.checkpoints or state.checkpointed:
                return dataclasses.replace(state, grow_pending=True), Keep()
            return _grow(state, f"{host} is back")
        case CheckpointComplete(step=step):
            state = dataclasses.replace(state, checkpointed=True)
            if not state.grow_pending:
                return state, Keep()
            return _grow(dataclasses.replace(state, grow_pending=False),
                         f"checkpoint of step {step} complete")
    raise AssertionError(f"unknown event {event!r}")


def _exclude(state: Membership, host: str, why: str) -> tuple[Membership, Decision]:
    out = {h for h, _ in state.excluded} | {host}
    state = dataclasses.replace(state, excluded=(*state.excluded, (host, why)))
    chosen = choose(state.policy, out)
    if chosen is None:
        return dataclasses.replace(state, active=()), Stop(
            f"{host} left ({why}); " + _too_few(state.policy, out, "now"))
    left = [f"{h} left ({why if h == host else 'fewer hosts keep the world size valid'}); "
            f"world size {state.policy.world(chosen)} on {','.join(chosen)}"
            for h in state.active if h not in chosen]
    return dataclasses.replace(state, active=chosen), Relaunch(
        chosen, tuple(left), after_failure=not left)


def _grow(state: Membership, because: str) -> tuple[Membership, Decision]:
    chosen = choose(state.policy, {h for h, _ in state.excluded})
    if chosen is None or len(chosen) <= len(state.active):
        return state, Keep()
    world = state.policy.world(chosen)
    joined = tuple(f"{h} joined ({because}); world size {world} on {','.join(chosen)}"
                   for h in chosen if h not in state.active)
    return dataclasses.replace(state, active=chosen), Relaunch(
        chosen, joined, after_failure=False)


def _too_few(policy: Policy, out: set[str], when: str) -> str:
    usable = [h for h in policy.hosts if h not in out]
    sizes = "" if policy.world_sizes is None else (
        f" at an allowed world size ({','.join(map(str, sorted(policy.world_sizes)))})")
    return (f"{len(usable)} usable host(s) {when}, fewer than --min_elastic_nodes "
            f"{policy.min_nodes}{sizes}: giving up")
