"""Curriculum schedules against DeepSpeed 0.19.8's recorded values, and the metric config's
checks (one-line errors at the metric's key path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepshard.data_efficiency.curriculum import (
    METRICS_PATH,
    CurriculumMetric,
    CurriculumScheduler,
    metrics_from_config,
)
from deepshard.errors import UsageError

FIXTURE = (Path(__file__).resolve().parents[2] / "data" / "data_efficiency"
           / "curriculum_schedule_ds0198.json")
RECORDED = json.loads(FIXTURE.read_text())["schedules"]


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_schedule_equals_deepspeed(name):
    record = RECORDED[name]
    spec = CurriculumMetric.from_dict(name, record["config"])
    got = [spec.difficulty_at(step) for step in range(len(record["get_difficulty"]))]
    assert got == record["get_difficulty"]
    assert [type(v) for v in got] == [type(v) for v in record["get_difficulty"]]
    scheduler = CurriculumScheduler(spec)
    steps = range(len(record["update_difficulty"]))
    updates = [scheduler.update_difficulty(step) for step in steps]
    assert updates == record["update_difficulty"]


def test_fixture_covers_the_required_schedules():
    kinds = {(r["config"]["schedule_type"], r["config"]["schedule_config"].get("root_degree"))
             for r in RECORDED.values()}
    assert {("fixed_discrete", None), ("fixed_linear", None), ("fixed_root", 2),
            ("fixed_root", 3)} <= kinds
    assert any(r["config"]["min_difficulty"] % r["config"]["schedule_config"].get(
        "difficulty_step", 1) for r in RECORDED.values())


def _discrete(difficulty, max_step, low=1, high=5):
    return {"min_difficulty": low, "max_difficulty": high, "schedule_type": "fixed_discrete",
            "schedule_config": {"difficulty": difficulty, "max_step": max_step}}


def test_update_stops_at_the_max():
    scheduler = CurriculumScheduler(CurriculumMetric.from_dict("m", _discrete([1, 5, 3], [2, 4])))
    assert [scheduler.update_difficulty(s) for s in range(1, 8)] == [1, 1, 5, 5, 5, 5, 5]
    assert scheduler.get_difficulty(7) == 3  # the schedule itself goes on


def test_custom_schedule():
    spec = CurriculumMetric.from_dict("m", {"min_difficulty": 8, "max_difficulty": 64,
                                            "schedule_type": "custom"})
    scheduler = CurriculumScheduler(spec)
    with pytest.raises(UsageError, match="no schedule function") as err:
        scheduler.update_difficulty(1)
    assert err.value.where == f"{METRICS_PATH}.m.schedule_type"
    scheduler.set_custom_get_difficulty(lambda step: min(64, 8 * step))
    assert [scheduler.update_difficulty(s) for s in (1, 4, 9, 10)] == [8, 32, 64, 64]


def test_defaults_and_kinds():
    spec = CurriculumMetric.from_dict("seqlen_truncate", {
        "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}})
    assert spec.single_cluster and spec.difficulty_type == "value"
    index = CurriculumMetric.from_dict("rarity", {
        **_discrete([1, 2], [3]), "clustering_type": "schedule_based",
        "difficulty_type": "percentile", "index_to_sample_path": "/x/rarity_index_to_sample"})
    assert not index.single_cluster and index.index_to_metric_path is None


BAD = [
    ({"max_difficulty": 5, "schedule_type": "fixed_discrete"}, "m.min_difficulty", "required"),
    ({**_discrete([1, 2], [3]), "min_difficulty": "1"}, "m.min_difficulty", "number"),
    ({**_discrete([1, 2], [3]), "schedule_type": "fixed_cubic"}, "m.schedule_type",
     "unknown schedule_type"),
    (_discrete([1, 2, 3], [5, 10, 20]), "m.schedule_config.difficulty", "exactly one more"),
    (_discrete([1, 2, 3], [5]), "m.schedule_config.difficulty", "exactly one more"),
    (_discrete([1, 2, 3], [10, 5]), "m.schedule_config.max_step", "must increase"),
    (_discrete([], [5]), "m.schedule_config.difficulty", "non-empty"),
    ({"min_difficulty": 1, "max_difficulty": 5, "schedule_type": "fixed_discrete",
      "schedule_config": {"max_step": [5]}}, "m.schedule_config.difficulty", "required"),
    ({"min_difficulty": 1, "max_difficulty": 5, "schedule_type": "fixed_linear"},
     "m.schedule_config", "needs its schedule_config"),
    ({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_root",
      "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}},
     "m.schedule_config.root_degree", "required"),
    ({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
      "schedule_config": {"total_curriculum_step": 0, "difficulty_step": 8}},
     "m.schedule_config.total_curriculum_step", "positive integer"),
    ({**_discrete([1, 2], [3]), "max_difficulty": 0}, "m.max_difficulty", "below"),
    ({**_discrete([1, 2], [3]), "difficulty_type": "rank"}, "m.difficulty_type",
     "unknown difficulty_type"),
    ({**_discrete([1, 2], [3]), "clustering_type": "schedule_based"},
     "m.index_to_sample_path", "index"),
    ({**_discrete([1, 2], [3]), "clustering_type": "schedule_based",
      "index_to_sample_path": "/x/s"}, "m.index_to_metric_path", "values"),
    ({**_discrete([0, 0], [3], low=0, high=0), "difficulty_type": "percentile",
      "clustering_type": "schedule_based", "index_to_sample_path": "/x/s"},
     "m.max_difficulty", "last percentile"),
]


@pytest.mark.parametrize(("config", "where", "message"), BAD)
def test_bad_metric_configs(config, where, message):
    with pytest.raises(UsageError, match=message) as err:
        CurriculumMetric.from_dict("m", config)
    assert err.value.where == f"{METRICS_PATH}.{where}"
    assert "\n" not in str(err.value)


def test_metrics_from_config():
    with pytest.raises(UsageError, match="curriculum_metrics") as err:
        metrics_from_config({"enabled": True})
    assert err.value.where == METRICS_PATH
    specs = metrics_from_config({"curriculum_metrics": {"a": _discrete([1, 2], [3]),
                                                        "b": _discrete([1, 2], [4])}})
    assert [s.name for s in specs] == ["a", "b"]


def test_scheduler_takes_deepspeeds_dict():
    """``CurriculumScheduler(config)`` as DeepSpeed's constructor is called."""
    scheduler = CurriculumScheduler({"min_difficulty": 8, "max_difficulty": 64,
                                     "schedule_type": "fixed_linear",
                                     "schedule_config": {"total_curriculum_step": 10,
                                                         "difficulty_step": 8}})
    assert [scheduler.update_difficulty(s) for s in (1, 5, 10, 20)] == [8, 32, 64, 64]
