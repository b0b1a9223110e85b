"""``deepshard.runtime.logs.logger`` / ``log_dist``: DeepSpeed's rank prefix and rank selection."""

from __future__ import annotations

import logging

import pytest

import deepshard.runtime.logs
from deepshard.runtime.logs import log_dist, log_dist_once, set_log_level_from_string


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "deepshard"]


def test_logger_is_the_runtimes():
    assert deepshard.runtime.logs.logger is logging.getLogger("deepshard")


def test_without_a_process_group_every_call_logs_as_rank_minus_one(caplog):
    with caplog.at_level(logging.INFO, logger="deepshard"):
        log_dist("hello")
        log_dist("there", ranks=[3], level=logging.WARNING)
    assert messages(caplog) == ["[Rank -1] hello", "[Rank -1] there"]
    assert caplog.records[-1].levelno == logging.WARNING


def test_with_a_process_group_only_the_named_ranks_log(caplog, one_rank_group):
    with caplog.at_level(logging.INFO, logger="deepshard"):
        log_dist("default ranks")  # DeepSpeed: ranks=None logs nowhere once a group exists
        log_dist("other rank", ranks=[1])
        log_dist("rank zero", ranks=[0])
        log_dist("everyone", ranks=[-1])
        log_dist_once("once", ranks=[0])
        log_dist_once("once", ranks=[0])
    assert messages(caplog) == ["[Rank 0] rank zero", "[Rank 0] everyone", "[Rank 0] once"]


def test_set_log_level_from_string():
    other = logging.getLogger("deepshard-test-level")
    set_log_level_from_string("debug", custom_logger=other)
    assert other.level == logging.DEBUG
    with pytest.raises(ValueError, match="Invalid log level"):
        set_log_level_from_string("loud", custom_logger=other)
