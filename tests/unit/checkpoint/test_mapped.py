"""Handing back the pages of memory-mapped checkpoint files
(:mod:`deepshard.runtime.checkpoint.mapped`): the pages go (the process's resident size
falls) and the tensors still read what the file holds."""

from __future__ import annotations

import sys

import psutil
import pytest
import torch

from deepshard.runtime.checkpoint.mapped import Release


@pytest.mark.skipif(sys.platform != "linux", reason="madvise on Linux only")
def test_released_pages_go_and_the_values_stay(tmp_path):
    values = torch.arange(16 * 2**20, dtype=torch.float32)  # 64 MiB
    torch.save({"a": values, "b": [values[:10].clone()]}, tmp_path / "f.pt")
    loaded = torch.load(tmp_path / "f.pt", mmap=True)
    mine = torch.ones(4)  # not the file's: left alone
    proc = psutil.Process()
    before = proc.memory_info().rss
    assert float(loaded["a"].sum()) == float(values.sum())  # every page read
    read = proc.memory_info().rss
    Release([loaded])()
    after = proc.memory_info().rss
    assert read - before > 48 * 2**20 and read - after > 48 * 2**20, (before, read, after)
    assert torch.equal(loaded["a"], values) and torch.equal(loaded["b"][0], values[:10])
    assert torch.equal(mine, torch.ones(4))
