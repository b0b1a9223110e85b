"""The random-LTD kept-token schedule against values recorded from DeepSpeed 0.19.8
(tests/data/data_efficiency/make_ltd_fixture.py wrote the fixture), and its config checks."""

from __future__ import annotations

import json
import pathlib

import pytest

from deepshard.data_efficiency.ltd_schedule import RandomLtdSchedule, RandomLtdSpec
from deepshard.errors import UsageError

FIXTURE = (pathlib.Path(__file__).parents[2] / "data" / "data_efficiency"
           / "ltd_schedule_ds0198.json")
RECORD = json.loads(FIXTURE.read_text())
NAMES = sorted(RECORD["configs"])


def spec_of(c: dict) -> RandomLtdSpec:
    n = c["random_ltd_layer_num"]
    return RandomLtdSpec(total_layer_num=c["total_layer_num"], random_ltd_layer_num=n,
                         random_ltd_layer_id=tuple(range(n)),
                         global_batch_size=c["global_batch_size"], min_value=c["min_value"],
                         max_value=c["max_value"], require_steps=c["require_steps"],
                         seq_per_step=c["seq_per_step"])


def run(schedule: RandomLtdSchedule, steps: range) -> dict:
    values, consumed, state_dicts = [], [], {}
    for step in steps:
        for _ in range(RECORD["calls_per_step"]):
            schedule.update_seq(step)
            values.append(schedule.get_current_seq())
            consumed.append(schedule.state.consumed_layer_tokens)
        if step % 50 == 0 or step == RECORD["resume_at"] - 1:
            state_dicts[str(step)] = schedule.state_dict()
    return {"values": values, "consumed": consumed, "state_dicts": state_dicts}


@pytest.mark.parametrize("name", NAMES)
def test_values_and_state_dicts_equal_deepspeed(name):
    rec = RECORD["configs"][name]
    schedule = RandomLtdSchedule(spec_of(rec["config"]))
    assert schedule.state_dict() == rec["initial_state_dict"]
    got = run(schedule, range(RECORD["steps"]))
    assert got["values"] == rec["values"]
    assert got["consumed"] == rec["consumed"]
    assert got["state_dicts"] == rec["state_dicts"]


@pytest.mark.parametrize("name", NAMES)
def test_resume_from_deepspeed_state_dict(name):
    rec = RECORD["configs"][name]
    schedule = RandomLtdSchedule(spec_of(rec["config"]))
    schedule.load_state_dict(rec["state_dicts"][str(RECORD["resume_at"] - 1)])
    assert run(schedule, range(RECORD["resume_at"], RECORD["steps"])) == rec["resumed"]


@pytest.mark.parametrize("name", NAMES)
def test_total_layer_tokens_leaves_the_state(name):
    rec = RECORD["configs"][name]
    schedule = RandomLtdSchedule(spec_of(rec["config"]))
    before = schedule.state_dict()
    assert schedule.get_total_layer_tokens(RECORD["steps"]) == rec["total_layer_tokens"]
    assert schedule.state_dict() == before


def test_value_stops_at_max():
    spec = RandomLtdSpec(total_layer_num=2, random_ltd_layer_num=1, random_ltd_layer_id=(0,),
                         global_batch_size=1, min_value=8, max_value=64, require_steps=10)
    schedule = RandomLtdSchedule(spec)
    schedule.update_seq(20)
    assert schedule.get_current_seq() == 64
    schedule.update_seq(3)  # not recomputed once at max
    assert schedule.get_current_seq() == 64


def test_load_state_dict_missing_key():
    schedule = RandomLtdSchedule(spec_of(RECORD["configs"][NAMES[0]]["config"]))
    with pytest.raises(UsageError, match="lacks current_value"):
        schedule.load_state_dict({"consumed_layer_tokens": 0, "current_steps": 1,
                                  "min_value": 1, "max_value": 2})


DS_SECTION = {
    "enabled": True, "total_layer_num": 24, "random_ltd_layer_num": 22,
    "random_ltd_layer_id": list(range(1, 23)), "model_mask_name": "attention_mask",
    "model_type": "decoder", "hidden_state_order": "seq_batch_dim",
    "random_ltd_schedule": {"min_value": 128, "max_value": 2048, "schedule_type": "fixed_linear",
                            "schedule_config": {"require_steps": 200000, "seq_per_step": 16}},
    "layer_token_lr_schedule": {"enabled": False},
}


def test_from_dict_reads_deepspeed_section():
    spec = RandomLtdSpec.from_dict(DS_SECTION, global_batch_size=256)
    assert spec.random_ltd_layer_id == tuple(range(1, 23))
    assert (spec.min_value, spec.max_value, spec.require_steps, spec.seq_per_step) == (
        128, 2048, 200000, 16)
    assert spec.hidden_state_order == "seq_batch_dim"
    assert spec.model_mask_name == "attention_mask"
    assert spec.global_batch_size == 256
    with_gbs = RandomLtdSpec.from_dict({**DS_SECTION, "global_batch_size": 8,
                                        "micro_batch_size": 2})
    assert with_gbs.global_batch_size == 8


def edit(path: str, value: object) -> dict:
    d = json.loads(json.dumps(DS_SECTION))
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node[p]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return d


P = "data_efficiency.data_routing.random_ltd."


@pytest.mark.parametrize(("path", "value", "where"), [
    ("random_ltd_schedule.schedule_type", "fixed_root", "random_ltd_schedule.schedule_type"),
    ("layer_token_lr_schedule.enabled", True, "layer_token_lr_schedule.enabled"),
    ("random_ltd_layer_num", 21, "random_ltd_layer_num"),
    ("random_ltd_layer_id", [1, 1], "random_ltd_layer_id"),
    ("random_ltd_layer_id", [30], "random_ltd_layer_id"),
    ("model_type", "seq2seq", "model_type"),
    ("hidden_state_order", "bsh", "hidden_state_order"),
    ("random_ltd_schedule.max_value", 64, "random_ltd_schedule.max_value"),
    ("random_ltd_schedule.min_value", 8, "random_ltd_schedule.schedule_config.seq_per_step"),
    ("random_ltd_schedule.schedule_config.require_steps", 0,
     "random_ltd_schedule.schedule_config.require_steps"),
    ("random_ltd_schedule.schedule_config.require_steps", KeyError,
     "random_ltd_schedule.schedule_config.require_steps"),
    ("random_ltd_schedule", KeyError, "random_ltd_schedule"),
    ("total_layer_num", "24", "total_layer_num"),
    ("random_ltd_schedule.min_vlaue", 1, "random_ltd_schedule.min_vlaue"),
])
def test_from_dict_errors_name_the_key(path, value, where):
    with pytest.raises(UsageError) as info:
        RandomLtdSpec.from_dict(edit(path, value), global_batch_size=4)
    assert info.value.where == P + where
    assert "\n" not in str(info.value)


def test_from_dict_needs_a_global_batch_size():
    with pytest.raises(UsageError, match="global batch size"):
        RandomLtdSpec.from_dict(DS_SECTION)
