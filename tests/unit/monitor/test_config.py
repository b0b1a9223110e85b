"""The monitor sections in the config tree: typed, DeepSpeed's keys, one-line errors with
the key path."""

from __future__ import annotations

import pytest

from deepshard.config import load_config
from deepshard.errors import UsageError


def load(data):
    return load_config({"train_batch_size": 2, **data}, world_size=1)


def error_of(data) -> UsageError:
    with pytest.raises(UsageError) as info:
        load(data)
    return info.value


def test_sections_are_validated_not_ignored():
    loaded = load({"csv_monitor": {"enabled": True, "output_path": "out", "job_name": "j"},
                   "tensorboard": {"enabled": False}, "wall_clock_breakdown": True,
                   "comet": {"enabled": False, "online": False, "mode": "create"},
                   "wandb": {"enabled": False, "team": "t", "group": "g", "project": "p"}})
    cfg = loaded.config
    assert loaded.unimplemented == ()
    assert cfg.wall_clock_breakdown and cfg.monitor_config.enabled
    assert (cfg.csv_monitor.output_path, cfg.csv_monitor.job_name) == ("out", "j")
    assert (cfg.wandb.team, cfg.wandb.group, cfg.wandb.project) == ("t", "g", "p")
    assert (cfg.comet.online, cfg.comet.mode) == (False, "create")
    assert not load({}).config.monitor_config.enabled


def test_a_misspelt_key_names_its_path():
    err = error_of({"csv_monitor": {"enabled": True, "output_pth": "x"}})
    assert err.where == "<dict>: csv_monitor.output_pth"
    assert "did you mean 'output_path'" in err.message and "job_name" in err.hint


def test_a_wrong_value_names_its_path():
    err = error_of({"tensorboard": {"enabled": "yes"}})
    assert err.where == "<dict>: tensorboard.enabled"
    assert "true or false" in str(err)
    err = error_of({"comet": {"mode": "fetch"}})
    assert err.where == "<dict>: comet.mode" and "get_or_create" in err.hint
    err = error_of({"wall_clock_breakdown": 3})
    assert err.where == "<dict>: wall_clock_breakdown"


@pytest.mark.parametrize("section", ["csv_monitor", "tensorboard", "wandb", "comet"])
def test_an_unknown_key_is_an_error_as_in_deepspeed(section):
    """DeepSpeed 0.19.8's monitor models forbid extra keys; other sections only warn."""
    err = error_of({section: {"enabled": False, "colour": "blue"}})
    assert err.where == f"<dict>: {section}.colour"
    assert err.message == "unknown key" and "enabled" in err.hint
    assert load({"fp16": {"enabled": False, "colour": "blue"}}).unknown == ("fp16.colour",)
