"""Straggler detection: which rank keeps the others waiting at every step.

The signal. Under synchronous data parallelism every rank's step takes the same wall time:
the gradient all-reduce waits for the slowest rank, so step rates cannot find it. What
differs is the time each rank spends on its *own* work of a step, from the end of the
previous step to its arrival at the step's synchronisation (:func:`deepshard.liveness.arrive`,
which the engine calls before it waits for its gradient all-reduce): a straggler arrives
last, the others arrive early and wait. Each worker measures that span on its own
monotonic clock, so no clocks are compared across hosts. A worker that never marks its
arrival is judged by its whole step time, which singles out a slow rank only where ranks do
not synchronise every step.

Limits: a rank that is slow *inside* the collective (a bad link, a slow NIC) arrives on time
and is not named (the whole job is slow instead); a step with several synchronisations
(ZeRO-3's gathers) is judged by the first; the own-work times are a sample when steps come
faster than the heartbeat file's ring holds per second (64).

:class:`StragglerDetector` is the pure policy (fed per-rank step times, returning verdicts);
:class:`StepWatch` keeps it and the per-rank step-time statistics across a job's attempts
for the coordinator, the live view and ``--summary_json``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from deepshard.contract import StepTime, WorkerStats


@dataclass(frozen=True, kw_only=True)
class StragglerPolicy:
    """When a rank is a straggler."""

    factor: float = 1.5
    """A rank whose own work per step (median over its window) is at least this many times
    the median of the other ranks' is flagged (``--straggler_factor``)."""
    window: int = 8
    """The last steps of each rank its median is taken over."""
    min_steps: int = 5
    """Steps a rank (and at least one other) must have reported before it is judged; with
    the median over the window, a few slow steps never flag a rank."""
    min_excess: float = 0.005
    """Seconds per step a flagged rank must also cost beyond the others' median: ratios of
    sub-millisecond times are noise."""
    clear_factor: float | None = None
    """A flagged rank is cleared only when its ratio falls below this (hysteresis);
    ``None``: halfway between 1 and :attr:`factor`."""

    def __post_init__(self) -> None:
        if not self.factor > 1.0:
            raise ValueError(f"factor must be > 1, not {self.factor}")
        if not 1 <= self.min_steps <= self.window:
            raise ValueError(f"min_steps must be within 1..window ({self.window}), not "
                             f"{self.min_steps}")

    @property
    def clear_below(self) -> float:
        return 1.0 + (self.factor - 1.0) / 2 if self.clear_factor is None else self.clear_factor


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """A rank's standing when it changed: flagged as a straggler, or cleared."""

    rank: int
    straggler: bool
    ratio: float
    """Its median own-work time over the median of the other ranks'."""
    own: float
    """Its median own-work seconds per step over its window."""
    others: float
    """The median over the other ranks of their median own-work seconds per step."""
    step: int
    """Its last step judged."""
    steps: int
    """How many of its steps the medians cover."""


class StragglerDetector:
    """Per-rank step times in, verdicts out (see :class:`StragglerPolicy`)."""

    def __init__(self, policy: StragglerPolicy):
        self.policy = policy
        self._times: dict[int, deque[float]] = {}
        self._last_step: dict[int, int] = {}
        self.flagged: dict[int, float] = {}
        """rank -> ratio, for the ranks flagged now."""

    def observe(self, rank: int, step: int, seconds: float) -> None:
        """Rank ``rank`` spent ``seconds`` of its own work on ``step``; a step at or below
        the last one seen from that rank is ignored (a repeat)."""
        if step <= self._last_step.get(rank, -1) or not math.isfinite(seconds):
            return
        self._last_step[rank] = step
        self._times.setdefault(rank, deque(maxlen=self.policy.window)).append(seconds)

    def evaluate(self) -> list[Verdict]:
        """Judge every rank with enough steps; returns the ranks whose standing changed."""
        p = self.policy
        medians = {r: _median(t) for r, t in self._times.items()
                   if len(t) >= p.min_steps}
        changes = []
        for rank, own in sorted(medians.items()):
            rest = [m for r, m in medians.items() if r != rank]
            if not rest:
                continue
            others = _median(rest)
            ratio = own / others if others > 0 else math.inf
            slow = own - others >= p.min_excess
            was = rank in self.flagged
            now = slow and ratio >= (p.clear_below if was else p.factor)
            if now:
                self.flagged[rank] = ratio
            else:
                self.flagged.pop(rank, None)
            if now != was:
                changes.append(Verdict(rank=rank, straggler=now, ratio=ratio, own=own,
                                       others=others, step=self._last_step[rank],
                                       steps=len(self._times[rank])))
        return changes


class TimeStats:
    """Count, max and approximate quantiles of a stream of seconds, in bounded memory:
    a histogram of buckets 1% wide (on a log scale), so quantiles are within 1%."""

    _BASE = math.log(1.01)

    def __init__(self) -> None:
        self.count = 0
        self.max = 0.0
        self._buckets: dict[int, int] = {}

    def add(self, seconds: float) -> None:
        self.count += 1
        self.max = max(self.max, seconds)
        key = math.floor(math.log(seconds) / self._BASE) if seconds > 0 else -(1 << 30)
        self._buckets[key] = self._buckets.get(key, 0) + 1

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (``None`` when empty), the middle of its bucket."""
        if not self.count:
            return None
        rank = q * (self.count - 1)
        seen = 0
        for key in sorted(self._buckets):
            seen += self._buckets[key]
            if seen > rank:
                return 0.0 if key == -(1 << 30) else min(self.max,
                                                          math.exp((key + 0.5) * self._BASE))
        return self.max

    def to_json(self) -> dict[str, object]:
        def rounded(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {"count": self.count, "median": rounded(self.quantile(0.5)),
                "p90": rounded(self.quantile(0.9)), "max": rounded(self.max if self.count
                                                                    else None)}


@dataclass
class _RankTimes:
    host: str
    step: TimeStats = field(default_factory=TimeStats)
    busy: TimeStats = field(default_factory=TimeStats)


class StepWatch:
    """A job's step times across its attempts: feeds a fresh :class:`StragglerDetector`
    per attempt, keeps per-rank statistics and every verdict (runtime state, not a spec)."""

    def __init__(self, policy: StragglerPolicy):
        self.policy = policy
        self.detector = StragglerDetector(policy)
        self.attempt = 0
        self.verdicts: list[tuple[int, str, Verdict]] = []
        """(attempt, host, verdict), in order."""
        self._ranks: dict[int, _RankTimes] = {}
        self._host_of: dict[int, str] = {}

    def new_attempt(self, attempt: int) -> None:
        """Relaunched workers: judge them afresh (their statistics carry on)."""
        self.attempt = attempt
        self.detector = StragglerDetector(self.policy)

    def observe(self, host: str, workers: Mapping[int, WorkerStats]) -> list[Verdict]:
        """An ``alive`` event of ``host``: record its workers' new steps and return the
        ranks whose standing changed (each also kept in :attr:`verdicts`)."""
        for rank, stats in workers.items():
            self._host_of[rank] = host
            self._add(host, rank, stats.times)
        changes = self.detector.evaluate()
        self.verdicts.extend((self.attempt, self._host_of[v.rank], v) for v in changes)
        return changes

    def host_of(self, rank: int) -> str:
        return self._host_of.get(rank, "?")

    def _add(self, host: str, rank: int, times: Iterable[StepTime]) -> None:
        record = self._ranks.get(rank)
        if record is None or record.host != host:  # a rank moved (elastic): start over
            record = self._ranks[rank] = _RankTimes(host)
        for t in times:
            record.step.add(t.seconds)
            if t.busy is not None:
                record.busy.add(t.busy)
            self.detector.observe(rank, t.step, t.seconds if t.busy is None else t.busy)

    def to_json(self) -> dict[str, object]:
        """Per-rank statistics and verdicts, for the job summary."""
        ranks = {str(rank): {"host": r.host, "step_s": r.step.to_json(),
                             "own_work_s": r.busy.to_json(),
                             "straggler": rank in self.detector.flagged,
                             "slow_ratio": _round(self.detector.flagged.get(rank))}
                 for rank, r in sorted(self._ranks.items())}
        p = self.policy
        return {
            "policy": {"factor": p.factor, "window": p.window, "min_steps": p.min_steps,
                       "min_excess_s": p.min_excess, "clear_below": p.clear_below},
            "ranks": ranks,
            "stragglers": sorted({f"{self._host_of.get(v.rank, '?')}:{v.rank}"
                                  for _, _, v in self.verdicts if v.straggler}),
            "verdicts": [{"attempt": a, "host": h, "rank": v.rank, "straggler": v.straggler,
                          "ratio": _round(v.ratio), "own_s": _round(v.own),
                          "others_s": _round(v.others), "step": v.step, "steps": v.steps}
                         for a, h, v in self.verdicts],
        }


def _median(values: Iterable[float]) -> float:
    ordered = sorted(values)  # not statistics.median: its import costs ds-run's start ~5 ms
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _round(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 4)
