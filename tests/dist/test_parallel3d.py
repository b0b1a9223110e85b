"""Pipeline, tensor and data parallelism combined, on real gloo groups, against one process.

The example script trains from the config alone (a ``pipeline`` section makes it build the
GPT as a ``PipelineModule``, ``tensor_parallel.autotp_size`` makes ``initialize`` shard it
with AutoTP); the reference is the same GPT in one process over the whole global batch.
"""

from __future__ import annotations

import sys

import pytest
import torch

import deepshard
from tests.dist.test_engine import (
    ADAMW,
    TINY,
    TINY_ARGS,
    TRAIN,
    assert_weights_close,
    losses_of,
    reference,
    write_config,
)
from tests.helpers import ROOT, run_ds

sys.path.insert(0, str(ROOT / "examples"))
from gpt_pipe import gpt_param_name


def run_layout(tmp_path, world: int, pipe: int, tp: int, zero: int, steps: int, ckdir,
               save_interval: int | None = None, micro: int = 2, gas: int = 4):
    cfg = write_config(tmp_path, train_micro_batch_size_per_gpu=micro,
                       gradient_accumulation_steps=gas, gradient_clipping=1.0,
                       optimizer=ADAMW, pipeline={"stages": pipe},
                       tensor_parallel={"autotp_size": tp},
                       zero_optimization={"stage": zero})
    result = run_ds("--num_gpus", str(world), TRAIN, "--deepspeed_config", cfg, "--steps",
                    str(steps), *TINY_ARGS, "--checkpoint_dir", str(ckdir), "--save_interval",
                    str(save_interval or steps), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses_of(result.stdout)


@pytest.mark.parametrize(("world", "pipe", "tp", "zero"), [
    (8, 2, 2, 1),  # pp=2 x tp=2 x dp=2
    (4, 2, 1, 1),  # pp=2 x dp=2
    (4, 1, 2, 1),  # tp=2 x dp=2
    (4, 4, 1, 0),  # pp=4, one replica
    (4, 1, 2, 3),  # tp=2 x dp=2 with ZeRO-3 on the data axis
])
def test_layout_follows_single_process(tmp_path, world, pipe, tp, zero):
    steps, micro, gas = 4, 2, 4
    dp = world // (pipe * tp)
    got = run_layout(tmp_path, world, pipe, tp, zero, steps, tmp_path / "ckpt")
    want, want_state = reference(steps, micro * gas * dp)
    assert sorted(got) == list(range(1, steps + 1))
    curve = [float(got[s + 1]) for s in range(steps)]
    torch.testing.assert_close(curve, want, rtol=1e-4, atol=0)
    # the checkpoint reassembles into the whole model (pipeline layers renamed back)
    state = deepshard.get_fp32_state_dict(tmp_path / "ckpt")
    if pipe > 1:
        state = {gpt_param_name(k, TINY): v for k, v in state.items()}
    assert_weights_close(state, want_state, rtol=1e-4)


def test_pipeline_resume_is_exact(tmp_path):
    whole = run_layout(tmp_path, 4, 2, 1, 1, 4, tmp_path / "a", save_interval=2)
    run_layout(tmp_path, 4, 2, 1, 1, 2, tmp_path / "b", save_interval=2)
    resumed = run_layout(tmp_path, 4, 2, 1, 1, 4, tmp_path / "b", save_interval=2)
    assert sorted(resumed) == [3, 4]
    assert {s: whole[s] for s in (3, 4)} == resumed


def test_resuming_at_another_layout_is_a_clear_error(tmp_path):
    run_layout(tmp_path, 4, 2, 1, 1, 1, tmp_path / "ckpt")
    cfg = write_config(tmp_path, train_micro_batch_size_per_gpu=2,
                       gradient_accumulation_steps=4, optimizer=ADAMW,
                       tensor_parallel={"autotp_size": 2})
    result = run_ds("--num_gpus", "4", TRAIN, "--deepspeed_config", cfg, "--steps", "2",
                    *TINY_ARGS, "--checkpoint_dir", str(tmp_path / "ckpt"), timeout=300)
    assert result.returncode == 2
    assert "layout" in result.stderr and "get_fp32_state_dict" in result.stderr
    assert "Traceback" not in result.stderr
