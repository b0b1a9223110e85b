"""The comms logger is process-wide (DeepSpeed's API): every test gets it back as it was."""

from __future__ import annotations

import copy

import pytest

from deepshard.comm.logger import comms_logger


@pytest.fixture(autouse=True)
def restore_comms_logger():
    saved = copy.deepcopy(vars(comms_logger))
    yield comms_logger
    vars(comms_logger).clear()
    vars(comms_logger).update(saved)
