"""The wandb monitor, offline (WANDB_MODE=offline, no network): a real run's records read
back from its ``.wandb`` file, and no wandb process left once the job has ended."""

from __future__ import annotations

import json
import struct

import pytest

from tests.unit.monitor.common import processes_left, run_python
from tests.unit.monitor.train_snippet import BASE, printed_steps, train_code

pytest.importorskip("wandb", reason="wandb is in the test extra")

BLOCK = 32768  # the .wandb file is a LevelDB-style log of protobuf Records


def wandb_records(path):
    """The protobuf ``Record`` messages of a ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack_from("<IHB", data, pos) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            pos += left  # block trailer
            continue
        pending = (b"" if kind in (1, 2) else pending) + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_offline_run_logs_deepspeeds_events_and_leaves_no_process(tmp_path):
    config = {**BASE, "wandb": {"enabled": True, "project": "proj", "group": "grp"}}
    result = run_python(train_code(config), tmp_path, {
        "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert processes_left(tmp_path) == []
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = list(wandb_records(run_file))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.run_group) == ("proj", "grp")
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    steps = printed_steps(result.stdout)
    assert [h["_step"] for h in history] == [samples for samples, _, _ in steps]
    for h, (_, loss, lr) in zip(history, steps, strict=True):
        assert h["Train/Samples/lr"] == lr
        assert h["Train/Samples/train_loss"] == pytest.approx(loss, rel=1e-6)
        assert {"Train/Samples/grad_norm", "Train/Samples/step_time_ms",
                "Train/Samples/samples_per_second"} <= set(h)


def test_online_without_an_api_key_is_one_line_and_exit_code_2(tmp_path):
    config = {**BASE, "wandb": {"enabled": True}}
    result = run_python(train_code(config), tmp_path, {"WANDB_DIR": str(tmp_path)})
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "deepshard: error" in line]
    assert line.startswith("deepshard: error: wandb.enabled: wandb could not start a run: "
                           "No API key configured")
    assert "WANDB_MODE=offline" in line and "Traceback" not in result.stderr
    assert processes_left(tmp_path) == []
