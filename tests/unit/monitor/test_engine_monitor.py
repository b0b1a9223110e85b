"""The engine's monitor events, timers and heartbeat loss, in one process: every value
checked against what the training loop itself saw."""

from __future__ import annotations

import csv
import logging
import re

import pytest
import torch

import deepshard
from deepshard import contract
from deepshard.liveness import FILE_SIZE, read_heartbeat
from tests.unit.monitor.common import read_scalars

GAS, STEPS, MICRO = 2, 3, 2


def train(tmp_path, *, extra=None, engine_backward=True, lr_lambda=lambda s: 1 / (s + 1)):
    """Train a linear model STEPS steps of GAS micro-batches; returns the engine and per
    step (loss of each micro-batch, grad norm, lr after the step, global samples, fp16
    loss scale after the step or None)."""
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "gradient_clipping": 0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"},
              **(extra or {})}
    engine, *_ = deepshard.initialize(
        model=torch.nn.Linear(4, 1), config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))
    seen = []
    for _ in range(STEPS):
        losses = []
        for _ in range(GAS):
            x, y = torch.randn(MICRO, 4), torch.randn(MICRO, 1)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            if engine_backward:
                engine.backward(loss)
            else:
                loss.backward()
            engine.step()
            losses.append(loss.item())
        scale = engine.loss_scaler.loss_scale if engine.loss_scaler is not None else None
        seen.append((losses, engine.get_global_grad_norm(), engine.get_lr()[0],
                     engine.global_samples, scale))
    return engine, seen


def rows(path) -> list[tuple[int, float]]:
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    return [(int(step), float(value)) for step, value in table[1:]]


def test_events_are_the_steps_values(tmp_path, one_process):
    pytest.importorskip("tensorboard", reason="tensorboard is in the test extra")
    tensorboard = {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "j"}
    engine, seen = train(tmp_path, extra={"wall_clock_breakdown": True,
                                          "tensorboard": tensorboard})
    job = tmp_path / "j"
    samples = [s for *_, s, _ in seen]
    assert samples == [4, 8, 12]
    assert rows(job / "Train_Samples_lr.csv") == [(s, lr) for _, _, lr, s, _ in seen]
    assert rows(job / "Train_Samples_grad_norm.csv") == [(s, n) for _, n, _, s, _ in seen]
    got = rows(job / "Train_Samples_train_loss.csv")
    assert [s for s, _ in got] == samples
    for (_, value), (losses, *_) in zip(got, seen, strict=True):
        assert value == pytest.approx(sum(losses) / GAS, rel=1e-6)
    for name in ("step_time_ms", "samples_per_second", "elapsed_time_ms_forward",
                 "elapsed_time_ms_backward", "elapsed_time_ms_backward_inner",
                 "elapsed_time_ms_step"):
        values = rows(job / f"Train_Samples_{name}.csv")
        assert [s for s, _ in values] == samples and all(v > 0 for _, v in values), name
    backward = rows(job / "Train_Samples_elapsed_time_ms_backward.csv")
    inner = rows(job / "Train_Samples_elapsed_time_ms_backward_inner.csv")
    rest = rows(job / "Train_Samples_elapsed_time_ms_backward_allreduce.csv")
    for (_, b), (_, i), (_, r) in zip(backward, inner, rest, strict=True):
        assert i <= b and r == pytest.approx(b - i)
    assert not (job / "Train_Samples_loss_scale.csv").exists()  # fp32
    timers = engine.get_wall_clock_timers()
    assert set(timers) == {"fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"}
    assert timers["fwd"] == rows(job / "Train_Samples_elapsed_time_ms_forward.csv")[-1][1]
    assert engine.monitor.enabled and engine.wall_clock_breakdown()
    engine.destroy()  # closes the monitors: the event file is complete
    scalars = read_scalars(tmp_path / "tb" / "j")
    assert sorted(tag.replace("/", "_") + ".csv" for tag in scalars) == sorted(
        p.name for p in job.iterdir())
    assert scalars["Train/Samples/lr"] == [
        (s, pytest.approx(lr, rel=1e-6)) for _, _, lr, s, _ in seen]


def test_without_wall_clock_breakdown_no_elapsed_events(tmp_path, one_process):
    engine, _ = train(tmp_path)
    names = sorted(p.name for p in (tmp_path / "j").iterdir())
    assert names == ["Train_Samples_grad_norm.csv", "Train_Samples_lr.csv",
                     "Train_Samples_samples_per_second.csv", "Train_Samples_step_time_ms.csv",
                     "Train_Samples_train_loss.csv"]
    assert engine.get_wall_clock_timers() == {}


def test_loss_backward_style_has_no_train_loss(tmp_path, one_process):
    train(tmp_path, engine_backward=False)
    job = tmp_path / "j"
    assert len(rows(job / "Train_Samples_lr.csv")) == STEPS
    assert not (job / "Train_Samples_train_loss.csv").exists()


def test_fp16_writes_the_loss_scale(tmp_path, one_process):
    """After each step, as an int (DeepSpeed's 2**16 is one); this run overflows at its
    first steps, so the rows also show the halved scale."""
    _, seen = train(tmp_path, extra={"fp16": {"enabled": True, "auto_cast": True}})
    scales = [scale for *_, scale in seen]
    assert len(set(scales)) > 1 and all(float(s).is_integer() for s in scales), scales
    want = "step,loss_scale\r\n" + "".join(f"{s},{int(scale)}\r\n"
                                           for *_, s, scale in seen)
    assert (tmp_path / "j" / "Train_Samples_loss_scale.csv").read_bytes() == want.encode()


TIME_LINE = re.compile(r"^time \(ms\) \| fwd: \d+\.\d\d \| bwd: \d+\.\d\d \| "
                       r"bwd_inner: \d+\.\d\d \| bwd_allreduce: \d+\.\d\d \| step: \d+\.\d\d$")


@pytest.mark.parametrize(("steps_per_print", "lines"), [(None, STEPS), (2, 1)])
def test_timer_line_every_steps_per_print(steps_per_print, lines, tmp_path, one_process,
                                          caplog):
    extra = {"wall_clock_breakdown": True, "csv_monitor": {"enabled": False}}
    if steps_per_print:
        extra["steps_per_print"] = steps_per_print
    with caplog.at_level(logging.INFO, logger="deepshard"):
        train(tmp_path, extra=extra)
    found = [r.getMessage() for r in caplog.records if r.getMessage().startswith("time (ms)")]
    assert len(found) == lines and all(TIME_LINE.match(line) for line in found), found
    assert not (tmp_path / "j").exists()


@pytest.mark.parametrize("engine_backward", [True, False])
def test_heartbeat_carries_the_steps_mean_loss(engine_backward, tmp_path, one_process,
                                               monkeypatch):
    beat = tmp_path / "heartbeat"
    beat.write_bytes(bytes(FILE_SIZE))  # as the agent makes it: the record, the checkpoint
    monkeypatch.setenv(contract.HEARTBEAT_FILE, str(beat))
    _, seen = train(tmp_path, extra={"csv_monitor": {"enabled": False}},
                    engine_backward=engine_backward)
    _, step, _, loss = read_heartbeat(str(beat))
    assert step == STEPS
    if engine_backward:
        assert loss == pytest.approx(sum(seen[-1][0]) / GAS, rel=1e-6)
    else:
        assert loss is None
