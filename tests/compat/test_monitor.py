"""``csv_monitor`` in a DeepSpeed-style script run unchanged under ``ds-run
--deepspeed_compat`` on 2 ranks: ``scripts/cifar_style.py`` with its config plus a
``csv_monitor`` section.

The lr file must be DeepSpeed 0.19.8's byte for byte: a row per optimizer step, the global
sample count (8, 16, ...) and the lr after the scheduler stepped, as Python prints the
float, ``\\r\\n`` line ends; the expected values come from WarmupLR's formula. The
train_loss series is the plain-torch reference's loss over each global batch.
"""

from __future__ import annotations

import json
import math

from tests.compat.common import TOL, loss_diff, run_compat
from tests.compat.test_cifar_style import CONFIG, reference

STEPS = 4  # the script's 32 samples in global batches of 8


def warmup_lr_after(steps: int, params: dict) -> float:
    """WarmupLR's (log warm-up) lr after ``steps`` scheduler steps, in DeepSpeed 0.19.8's
    float arithmetic (``min + delta * (1 / log(n) * log(i + 1))``: the order of the float
    operations decides the last digit the file shows)."""
    i, n = steps - 1, max(2, params["warmup_num_steps"])
    lo, hi = params["warmup_min_lr"], params["warmup_max_lr"]
    gamma = (1.0 / math.log(n)) * math.log(i + 1) if i < n else 1.0
    return lo + (hi - lo) * gamma


def test_csv_monitor_writes_deepspeeds_lr_file_and_the_global_loss(tmp_path):
    out = tmp_path / "csv"
    config = {**CONFIG, "csv_monitor": {"enabled": True, "output_path": str(out),
                                        "job_name": "cifar"}}
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    run_compat("cifar_style.py", tmp_path / "ranks", "--deepspeed_config",
               str(tmp_path / "ds_config.json"), "--stage", "2")
    job = out / "cifar"
    assert sorted(p.name for p in job.iterdir()) == [
        "Train_Samples_grad_norm.csv", "Train_Samples_lr.csv",
        "Train_Samples_samples_per_second.csv", "Train_Samples_step_time_ms.csv",
        "Train_Samples_train_loss.csv"]
    batch, params = CONFIG["train_batch_size"], CONFIG["scheduler"]["params"]
    want = "step,lr\r\n" + "".join(f"{batch * (step + 1)},{warmup_lr_after(step + 1, params)!r}\r\n"
                                   for step in range(STEPS))
    assert (job / "Train_Samples_lr.csv").read_bytes() == want.encode()
    lines = (job / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert lines[0] == "step,train_loss"  # one header: only rank 0 wrote
    rows = [line.split(",") for line in lines[1:]]
    assert [int(step) for step, _ in rows] == [batch * (s + 1) for s in range(STEPS)]
    want_losses, _ = reference()
    assert loss_diff([float(v) for _, v in rows], want_losses) < TOL


def test_pipeline_train_loss_is_what_train_batch_returned(tmp_path):
    """A 2-stage pipeline (scripts/pipeline_mlp.py): rank 0 (the first stage, which has no
    loss of its own) writes the mean loss train_batch returned, as DeepSpeed's pipeline
    engine writes ``Train/Samples/train_loss``; the lr rows are the constant lr."""
    from tests.compat.test_pipeline import CONFIG as PIPE_CONFIG

    out = tmp_path / "csv"
    config = {**PIPE_CONFIG, "csv_monitor": {"enabled": True, "output_path": str(out),
                                             "job_name": "pipe"}}
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    ranks = run_compat("pipeline_mlp.py", tmp_path / "ranks", "--deepspeed_config",
                       str(tmp_path / "ds_config.json"), "--steps", str(STEPS))
    batch, lr = PIPE_CONFIG["train_batch_size"], PIPE_CONFIG["optimizer"]["params"]["lr"]
    job = out / "pipe"
    assert (job / "Train_Samples_train_loss.csv").read_bytes() == (
        "step,train_loss\r\n" + "".join(f"{batch * (s + 1)},{loss!r}\r\n"
                                       for s, loss in enumerate(ranks[0]["losses"]))).encode()
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert (job / "Train_Samples_lr.csv").read_bytes() == (
        "step,lr\r\n" + "".join(f"{batch * (s + 1)},{lr!r}\r\n" for s in range(STEPS))).encode()
