"""A bad ds_config.json through a real job: one line per rank naming the key, exit code 2."""

from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, run_ds

TRAIN = str(ROOT / "examples" / "train_gpt.py")
TINY = ("--n_layer", "1", "--d_model", "32", "--n_head", "2", "--vocab_size", "256",
        "--seq_len", "16", "--steps", "2")
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3}}

CASES = [
    ("typo", {"train_batch_sise": 8, "train_micro_batch_size_per_gpu": 2},
     ["train_batch_sise: unknown key, did you mean 'train_batch_size'"]),
    ("triad", {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
               "gradient_accumulation_steps": 3},
     ["train_batch_size 8 != train_micro_batch_size_per_gpu 2 * gradient_accumulation_steps 3"
      " * world size 2 = 12", "HINT:"]),
    ("nested-value", {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW,
                      "zero_optimization": {"stage": 7}},
     ["zero_optimization.stage"]),
    ("unsupported-optimizer", {"train_micro_batch_size_per_gpu": 2,
                               "optimizer": {"type": "RMSprop", "params": {"lr": 1e-3}}},
     ["optimizer.type", "'RMSprop' is not yet supported"]),
    ("one-bit-at-a-stage-it-cannot-run", {
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}},
     ["zero_optimization.stage", "OneBitAdam at ZeRO stage 2", "use stage 0 or 1"]),
]


@pytest.mark.parametrize(("config", "fragments"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_config_fails_the_job_in_one_line(tmp_path, config, fragments):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    result = run_ds("--num_gpus", "2", TRAIN, "--deepspeed_config", str(path), *TINY,
                    timeout=180)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if "deepshard: error:" in line]
    assert len(errors) == 2, result.stdout  # one line from each rank
    for line in errors:
        assert f"{path}: " in line
        for fragment in fragments:
            assert fragment in line
    assert "Traceback" not in result.stdout + result.stderr


def test_unimplemented_keys_warn_once_and_train(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW,
                                "memory_breakdown": True,
                                "aio": {"block_size": 1048576}}))
    result = run_ds("--num_gpus", "2", TRAIN, "--deepspeed_config", str(path), *TINY,
                    timeout=180)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in (result.stdout + result.stderr).splitlines()
                if "does not implement" in line]
    assert len(warnings) == 1 and "memory_breakdown" in warnings[0] \
        and "aio" in warnings[0]
    assert "step 2 loss" in result.stdout
