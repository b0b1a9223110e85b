"""The ``data_efficiency`` section: DeepSpeed's keys validated with their key paths, the
switches' agreement, and the refusals (the legacy top-level ``curriculum_learning``, the
layer-token LR schedule)."""

from __future__ import annotations

import pytest

from deepshard.config.schema import validate_config
from deepshard.errors import UsageError

SEQLEN = {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
          "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}
LTD = {"enabled": True, "total_layer_num": 4, "random_ltd_layer_num": 2,
       "random_ltd_layer_id": [1, 2],
       "random_ltd_schedule": {"min_value": 8, "max_value": 64,
                               "schedule_config": {"require_steps": 10}}}


def section(**parts) -> dict:
    return {"train_batch_size": 8, "data_efficiency": {"enabled": True, **parts}}


def error(config: dict) -> str:
    with pytest.raises(UsageError) as info:
        validate_config(config, origin="ds.json")
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_full_section_validates_and_reads_back_as_deepspeeds_dict():
    cfg, unimplemented, unknown = validate_config(section(
        data_sampling={"enabled": True, "curriculum_learning": {
            "enabled": True, "curriculum_metrics": {"seqlen_truncate": SEQLEN}}},
        data_routing={"enabled": True, "random_ltd": LTD}))
    assert unimplemented == () and unknown == ()
    de = cfg.data_efficiency
    assert de.any_enabled()
    dumped = de.as_deepspeed()
    metric = dumped["data_sampling"]["curriculum_learning"]["curriculum_metrics"]
    assert metric["seqlen_truncate"]["min_difficulty"] == 8  # an int stays an int
    assert metric["seqlen_truncate"]["clustering_type"] == "single_cluster"
    assert dumped["data_routing"]["random_ltd"]["random_ltd_schedule"]["schedule_config"] == \
        {"require_steps": 10, "seq_per_step": 1}
    assert dumped["seed"] == 1234


def test_a_misspelt_key_names_its_metric_path():
    bad = {**SEQLEN, "schedule_config": {"total_curriculum_stp": 10, "difficulty_step": 8}}
    message = error(section(data_sampling={"enabled": True, "curriculum_learning": {
        "enabled": True, "curriculum_metrics": {"seqlen_truncate": bad}}}))
    assert message.startswith("ds.json: data_efficiency.data_sampling.curriculum_learning."
                              "curriculum_metrics.seqlen_truncate.schedule_config."
                              "total_curriculum_stp")
    assert "did you mean 'total_curriculum_step'" in message


@pytest.mark.parametrize("parts, words", [
    ({"data_routing": {"enabled": True, "random_ltd": {"enabled": True}}},
     "total_layer_num, random_ltd_layer_num, random_ltd_schedule are not set"),
    ({"data_sampling": {"enabled": True, "dynamic_batching": {"enabled": True}}},
     "max_tokens is not set"),
    ({"data_sampling": {"enabled": True, "curriculum_learning": {"enabled": True}}},
     "curriculum_metrics is empty"),
    ({"data_routing": {"random_ltd": LTD}}, "data_routing.enabled is false"),
    ({"data_routing": {"random_ltd": {"layer_token_lr_schedule": {"enabled": True}}}},
     "not implemented"),
])
def test_incomplete_or_contradictory_sections_are_refused(parts, words):
    assert words in error(section(**parts))


def test_the_removed_top_level_curriculum_learning_is_refused():
    message = error({"train_batch_size": 8, "curriculum_learning": {"enabled": True}})
    assert message.startswith("ds.json: curriculum_learning: ")
    assert "data_efficiency.data_sampling.curriculum_learning" in message
