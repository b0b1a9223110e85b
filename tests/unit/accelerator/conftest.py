"""The accelerator is process-wide (DeepSpeed's API): every test gets the selection back."""

from __future__ import annotations

import pytest

from deepshard.accelerator import real_accelerator


@pytest.fixture(autouse=True)
def restore_selection():
    saved = real_accelerator._SELECTED.accelerator
    yield
    real_accelerator._SELECTED.accelerator = saved
