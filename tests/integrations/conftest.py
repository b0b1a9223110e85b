"""The integration tests that run in the pytest process leave no process group behind:
transformers' ``TrainingArguments`` starts one through Accelerate's ``PartialState``, and
a later test's own one-rank group would then fail to start."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def no_process_group_left():
    had = dist.is_initialized()
    yield
    if not had and dist.is_initialized():
        from accelerate.state import AcceleratorState, PartialState

        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()
        if dist.is_initialized():
            dist.destroy_process_group()
