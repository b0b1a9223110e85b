"""Straggler detection: the pure detector, the step-time record a worker's heartbeat file
carries to its agent, the coordinator's one-line verdicts and the ``--summary_json`` file."""

from __future__ import annotations

import io
import json
import os
import struct

import pytest

from deepshard import contract, liveness
from deepshard.errors import UsageError
from deepshard.launcher.coordinator import Coordinator, Failure
from deepshard.launcher.straggler import (
    StepWatch,
    StragglerDetector,
    StragglerPolicy,
    TimeStats,
)
from deepshard.launcher.summary import JobRecord, check_summary_path, write_summary
from tests.unit.launcher.test_coordinator import ScriptedBackend, ev, plan


def feed(detector: StragglerDetector, times: dict[int, list[float]], start: int = 1) -> list:
    """Each rank's own-work seconds for consecutive steps; the verdicts of each round."""
    changes = []
    for i in range(max(map(len, times.values()))):
        for rank, series in times.items():
            if i < len(series):
                detector.observe(rank, start + i, series[i])
        changes += detector.evaluate()
    return changes


def test_a_rank_that_stays_slow_is_flagged_once_after_min_steps():
    detector = StragglerDetector(StragglerPolicy(factor=1.5, window=8, min_steps=5))
    changes = feed(detector, {0: [0.03] * 10, 1: [0.18] * 10, 2: [0.031] * 10})
    assert [(v.rank, v.straggler, v.step) for v in changes] == [(1, True, 5)]
    (v,) = changes
    assert v.ratio == pytest.approx(0.18 / 0.0305) and v.others == pytest.approx(0.0305)
    assert detector.flagged == {1: pytest.approx(0.18 / 0.0305)}


def test_one_or_a_few_slow_steps_do_not_flag():
    detector = StragglerDetector(StragglerPolicy(window=8, min_steps=5))
    slow = [0.03] * 20
    slow[6] = slow[12] = slow[13] = 1.0  # a checkpoint, a GC pause: not a straggler
    assert feed(detector, {0: [0.03] * 20, 1: slow}) == []


def test_hysteresis_keeps_a_flag_until_the_ratio_falls_below_the_clear_level():
    detector = StragglerDetector(StragglerPolicy(factor=1.5, window=4, min_steps=4))
    flagged = feed(detector, {0: [0.1] * 4, 1: [0.2] * 4})
    assert [v.straggler for v in flagged] == [True]
    # 1.4x: below the factor, above the clear level (1.25): still a straggler
    assert feed(detector, {0: [0.1] * 8, 1: [0.14] * 8}, start=5) == []
    assert 1 in detector.flagged
    cleared = feed(detector, {0: [0.1] * 4, 1: [0.11] * 4}, start=13)
    assert [(v.rank, v.straggler) for v in cleared] == [(1, False)]
    assert detector.flagged == {}


def test_two_ranks_compare_each_with_the_other_not_with_their_mean():
    detector = StragglerDetector(StragglerPolicy(factor=1.5, min_steps=3, window=3))
    # the mean of 0.1 and 0.2 would make 0.2 only 1.33x: the other rank's median is 0.1
    changes = feed(detector, {0: [0.1] * 3, 1: [0.2] * 3})
    assert [(v.rank, v.ratio) for v in changes] == [(1, pytest.approx(2.0))]


def test_tiny_times_and_lone_ranks_are_not_judged():
    detector = StragglerDetector(StragglerPolicy(min_steps=2, window=2, min_excess=0.005))
    assert feed(detector, {0: [0.0005] * 3, 1: [0.002] * 3}) == []  # 4x, but 1.5 ms
    lone = StragglerDetector(StragglerPolicy(min_steps=2, window=2))
    assert feed(lone, {0: [5.0] * 3}) == []
    few = StragglerDetector(StragglerPolicy(min_steps=5, window=8))
    assert feed(few, {0: [0.1] * 4, 1: [1.0] * 4}) == []  # 4 steps < min_steps


def test_repeated_and_old_steps_are_ignored():
    detector = StragglerDetector(StragglerPolicy(min_steps=2, window=2))
    for _ in range(5):
        detector.observe(0, 1, 0.1)
        detector.observe(1, 1, 1.0)
    assert detector.evaluate() == []  # one step each, however often it is reported
    detector.observe(1, 0, 1.0)
    detector.observe(1, 2, float("nan"))
    assert detector.evaluate() == []


def test_policy_is_checked():
    with pytest.raises(ValueError, match="factor"):
        StragglerPolicy(factor=1.0)
    with pytest.raises(ValueError, match="min_steps"):
        StragglerPolicy(window=4, min_steps=5)
    assert StragglerPolicy(factor=2.0).clear_below == 1.5


def test_time_stats_quantiles_within_one_percent():
    stats = TimeStats()
    assert stats.to_json() == {"count": 0, "median": None, "p90": None, "max": None}
    for i in range(1, 101):
        stats.add(i / 100)
    stats.add(0.0)
    summary = stats.to_json()
    assert summary["count"] == 101 and summary["max"] == 1.0
    assert summary["median"] == pytest.approx(0.50, rel=0.011)
    assert summary["p90"] == pytest.approx(0.90, rel=0.011)


def times(*entries: tuple[int, float, float | None]) -> tuple[contract.StepTime, ...]:
    return tuple(contract.StepTime(step=s, seconds=t, busy=b) for s, t, b in entries)


def test_step_watch_judges_own_work_and_falls_back_to_step_time():
    watch = StepWatch(StragglerPolicy(min_steps=2, window=2))
    for step in (1, 2):
        fast = contract.WorkerStats(step=step, times=times((step, 0.2, 0.03)))
        slow = contract.WorkerStats(step=step, times=times((step, 0.2, 0.18)))
        changes = watch.observe("h", {0: fast, 1: slow, 2: fast})
    assert [(v.rank, v.straggler) for v in changes] == [(1, True)]
    data = watch.to_json()
    assert data["stragglers"] == ["h:1"]
    assert data["ranks"]["1"]["own_work_s"]["count"] == 2
    assert data["ranks"]["1"]["step_s"]["median"] == pytest.approx(0.2, rel=0.01)
    assert data["ranks"]["1"]["straggler"] and not data["ranks"]["0"]["straggler"]
    # no arrival marks (busy None): equal step times, as synchronous ranks have: no verdict
    plain = StepWatch(StragglerPolicy(min_steps=2, window=2))
    for step in (1, 2, 3):
        stats = contract.WorkerStats(step=step, times=times((step, 0.2, None)))
        assert plain.observe("h", {0: stats, 1: stats}) == []
    assert plain.to_json()["ranks"]["0"]["own_work_s"]["count"] == 0
    # a new attempt judges afresh, its statistics carry on
    watch.new_attempt(1)
    assert watch.detector.flagged == {}
    assert watch.to_json()["ranks"]["1"]["step_s"]["count"] == 2


# -- the heartbeat file's step ring ----------------------------------------------------------

@pytest.fixture
def beat_file(tmp_path, monkeypatch):
    path = tmp_path / "rank_0"
    path.write_bytes(bytes(liveness.FILE_SIZE))
    monkeypatch.setenv(contract.HEARTBEAT_FILE, str(path))
    liveness._beater.cache_clear()
    yield path
    liveness._beater.cache_clear()


def test_a_beat_on_a_new_step_records_its_time_and_own_work(beat_file, monkeypatch):
    clock = iter(range(10**9, 10**12, 10**8))  # 0.1 s per reading
    monkeypatch.setattr(liveness.time, "monotonic_ns", lambda: next(clock))
    liveness.heartbeat(1)  # t=0: the first step's end; nothing to time before it
    liveness.arrive()  # t=0.1
    liveness.arrive()  # only the first arrival of a step counts
    liveness.heartbeat(2)  # t=0.2
    liveness.heartbeat(2)  # t=0.3: the same step again (a micro-batch): no record
    liveness.heartbeat(3)  # t=0.4: no arrival marked
    count, records = liveness.read_steps(str(beat_file), 0)
    assert count == 2
    assert records == [(2, 2 * 10**8, 10**8), (3, 2 * 10**8, -1)]
    assert liveness.read_steps(str(beat_file), 2) == (2, [])
    assert liveness.read_heartbeat(str(beat_file))[1] == 3


def test_the_ring_keeps_the_last_steps_and_drops_torn_records(beat_file):
    for step in range(1, liveness.RING + 11):
        liveness.heartbeat(step)
    count, records = liveness.read_steps(str(beat_file), 0)
    assert count == liveness.RING + 9
    assert [r[0] for r in records] == list(range(11, liveness.RING + 11))
    # a record half overwritten while read: its two step fields differ
    data = bytearray(beat_file.read_bytes())
    at = liveness._STEPS_AT + liveness.STEPS.size + (count - 1) % liveness.RING * \
        liveness.STEP_RECORD.size
    struct.pack_into("<q", data, at, 999)
    beat_file.write_bytes(bytes(data))
    assert [r[0] for r in liveness.read_steps(str(beat_file), count - 2)[1]] == [
        liveness.RING + 9]


def test_an_older_agents_short_file_still_gets_heartbeats(tmp_path, monkeypatch):
    path = tmp_path / "old"
    path.write_bytes(bytes(liveness.RECORD.size + liveness.CHECKPOINT.size))
    monkeypatch.setenv(contract.HEARTBEAT_FILE, str(path))
    liveness._beater.cache_clear()
    try:
        liveness.heartbeat(1)
        liveness.arrive()
        liveness.heartbeat(2, loss=0.5)
        assert liveness.read_heartbeat(str(path))[1:4:2] == (2, 0.5)
        assert liveness.read_steps(str(path), 0) == (0, [])
    finally:
        liveness._beater.cache_clear()


def test_arrive_outside_ds_run_does_nothing(monkeypatch):
    monkeypatch.delenv(contract.HEARTBEAT_FILE, raising=False)
    liveness.arrive()


def test_step_times_travel_in_alive_events_and_old_events_still_parse():
    stats = contract.WorkerStats(step=4, times=times((3, 0.25, 0.1), (4, 0.25, None)))
    line = ev(contract.Alive(host="h", workers={0: stats}))
    assert contract.decode_line(line) == contract.Alive(host="h", workers={0: stats})
    old = '{"kind":"alive","host":"h","workers":{"0":{"step":4,"beat_age":0.1}}}'
    parsed = contract.decode_line("e " + old)
    assert isinstance(parsed, contract.Alive) and parsed.workers[0].times == ()
    assert contract.decode_line("e " + old.replace('"step":4,', '"step":4,"times":[[1]],')) \
        is None


# -- the coordinator's verdict lines ---------------------------------------------------------

def alive(step: int, busy: dict[int, float]) -> str:
    return ev(contract.Alive(host="a", workers={
        r: contract.WorkerStats(step=step, times=times((step, 0.2, b)))
        for r, b in busy.items()}))


def test_coordinator_names_a_straggler_in_one_line_and_its_recovery():
    lines = [alive(s, {0: 0.03, 1: 0.03, 2: 0.18}) for s in range(1, 11)]
    lines += [alive(s, {0: 0.03, 1: 0.03, 2: 0.03}) for s in range(11, 21)]
    lines += [ev(contract.Done(state="succeeded"))]
    err = io.StringIO()
    coordinator = Coordinator(plan(["a"]), ScriptedBackend({"a": (lines, False)}),
                              out=io.StringIO(), err=err)
    assert coordinator.run() == 0
    said = err.getvalue().splitlines()
    assert len(said) == 2, said
    assert said[0].startswith("ds-run: straggler: rank 2 on a (a:2) works 6.0x as long")
    assert said[1].startswith("ds-run: rank 2 on a (a:2) is no longer a straggler")


# -- the summary file ------------------------------------------------------------------------

class _Ended:
    def __init__(self, failure: Failure | None, stop_signal: int | None = None):
        self.failure = failure
        self.stop_signal = stop_signal


def test_summary_of_a_failed_job(tmp_path):
    job = JobRecord("run1", StragglerPolicy())
    watch = job.attempt_started(0)
    watch.observe("h", {0: contract.WorkerStats(step=1, times=times((1, 0.5, 0.25)))})
    job.last = _Ended(Failure("h", 0, 3, "exit code 3"))  # type: ignore[assignment]
    path = tmp_path / "summary.json"
    write_summary(str(path), job.to_json(3))
    data = json.loads(path.read_text())
    assert data["exit_code"] == 3 and not data["succeeded"] and data["attempts"] == 1
    assert data["failure"] == {"host": "h", "rank": 0, "returncode": 3,
                               "reason": "exit code 3", "lost": False}
    assert data["ranks"]["0"]["own_work_s"]["count"] == 1
    assert data["stragglers"] == [] and data["policy"]["factor"] == 1.5
    assert os.listdir(tmp_path) == ["summary.json"]  # no temporary file left behind


def test_summary_of_a_stopped_job_and_of_a_usage_error():
    job = JobRecord("run1", StragglerPolicy())
    job.last = _Ended(None, 2)  # type: ignore[assignment]
    data = job.to_json(130)
    assert data["stop_signal"] == "SIGINT" and data["failure"] is None
    job.usage_error = "host b: unreachable"
    assert job.to_json(2)["failure"] == {"reason": "host b: unreachable"}


def test_summary_path_is_checked_before_anything_starts(tmp_path):
    check_summary_path(None)
    check_summary_path(str(tmp_path / "s.json"))
    with pytest.raises(UsageError, match=r"--summary_json .*: is a directory\. HINT"):
        check_summary_path(str(tmp_path))
    with pytest.raises(UsageError, match=r"does not exist\. HINT: create it"):
        check_summary_path(str(tmp_path / "missing" / "s.json"))
