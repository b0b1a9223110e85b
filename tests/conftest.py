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
