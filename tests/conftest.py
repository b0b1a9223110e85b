"""Shared fixtures: prove that no process outlives a test's job."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from tests.helpers import wait_until_gone


@pytest.fixture
def job_token(tmp_path: Path):
    """A unique string to put on a job's command line; after the test no process may
    still carry it (the no-orphan guarantee, checked after every test that uses it)."""
    token = f"dsjob-{tmp_path.name}-{os.getpid()}"
    yield token
    survivors = wait_until_gone(token)
    for pid, _ in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    assert not survivors, f"processes outlived the job: {survivors}"


_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def one_process(monkeypatch):
    """No launcher's rank variables, so ``deepshard.initialize`` starts a one-process
    group of its own; whatever group the test leaves is destroyed after it."""
    import torch.distributed as dist  # the launcher's tests run without torch

    for key in _RANK_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo process group over a file store, destroyed after the test."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
