"""The tensorboard monitor: DeepSpeed's tags and values in event files that TensorBoard's
own reader reads back; an enabled tensorboard without the package is one line at
initialize, exit code 2."""

from __future__ import annotations

import pytest

from deepshard.monitor.config import get_monitor_config
from deepshard.monitor.monitor import MonitorMaster
from tests.unit.monitor.common import read_scalars, run_python

pytest.importorskip("tensorboard", reason="tensorboard is in the test extra")


def test_events_read_back_with_tensorboards_reader(tmp_path):
    cfg = get_monitor_config({"tensorboard": {"enabled": True, "output_path": str(tmp_path),
                                              "job_name": "job"}})
    master = MonitorMaster(cfg, rank=0)
    master.write_events([("Train/Samples/lr", 0.25, 4), ("Train/Samples/train_loss", 2.5, 4)])
    master.write_events([("Train/Samples/lr", 0.125, 8)])
    master.close()
    assert read_scalars(tmp_path / "job") == {
        "Train/Samples/lr": [(4, 0.25), (8, 0.125)],
        "Train/Samples/train_loss": [(4, 2.5)]}


def test_only_rank_0_writes(tmp_path):
    cfg = get_monitor_config({"tensorboard": {"enabled": True, "output_path": str(tmp_path)}})
    MonitorMaster(cfg, rank=1).write_events([("Train/Samples/lr", 0.25, 4)])
    assert list(tmp_path.iterdir()) == []


MISSING = """
import sys
sys.modules["tensorboard"] = None  # what an environment without it gives: ImportError
import torch, deepshard
deepshard.initialize(model=torch.nn.Linear(2, 1), config={
    "train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "tensorboard": {"enabled": True}})
print("initialized")
"""


def test_missing_tensorboard_is_one_line_and_exit_code_2(tmp_path):
    result = run_python(MISSING, tmp_path, {})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "initialized" not in result.stdout
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert lines == ["deepshard: error: tensorboard.enabled: the tensorboard package this "
                     "monitor needs is not installed. HINT: pip install tensorboard (or pip "
                     "install 'deepshard[monitor]'), or set tensorboard.enabled to false"]
    assert "Traceback" not in result.stderr
