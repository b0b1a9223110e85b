"""deepshard's HF ``Trainer`` with Ulysses sequence parallelism 2 trains a tiny Llama as
plain torch trains it on one process (``scripts/hf_trainer_sp_train.py``: per-step losses
and gradient norms, fp32, relative 1e-5): SP 2 on 2 ranks at ZeRO-2 with gradient
accumulation 2 (the config's ``sequence_parallel_size``), SP 2 x DP 2 on 4 ranks at ZeRO-3
(HF's ``parallelism_config``). Unevenly padded samples: the loss is the token mean over
every valid token of the step. The ``"auto"`` fill of ``sequence_parallel_size`` and the
batch triad is checked without processes."""

from __future__ import annotations

import json

import pytest

from deepshard.errors import UsageError
from deepshard.integrations.hf_auto import HfTrainerDeepShardConfig
from tests.helpers import ROOT, run_ds

SCRIPT = str(ROOT / "tests" / "integrations" / "scripts" / "hf_trainer_sp_train.py")
RTOL = 1e-5


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= RTOL * abs(b)
                                         for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize(("ranks", "case"), [(2, "sp2:2:2:config"), (4, "sp2dp2:3:1:hf")])
def test_trainer_with_sequence_parallelism_trains_as_plain_torch(tmp_path, ranks, case):
    result = run_ds("--num_gpus", str(ranks), SCRIPT, "--out_dir", str(tmp_path), case,
                    timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    name, _, gas, _ = case.split(":")
    got = json.loads((tmp_path / f"{name}.json").read_text())
    want = got["reference"]
    assert got["steps"] == [1, 2, 3, 4]
    assert (got["sp"], got["dp"]) == (2, ranks)  # gradients averaged over data x sequence
    assert got["train_batch_size"] == 2 * int(gas) * ranks // 2  # a group is one replica
    assert close(got["losses"], want["losses"]), (got["losses"], want["losses"])
    assert close(got["grad_norms"], want["grad_norms"]), (got["grad_norms"],
                                                          want["grad_norms"])


@pytest.fixture
def world_of_4(monkeypatch, tmp_path):
    import transformers

    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda _: 4))
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3,
        gradient_accumulation_steps=2, report_to="none", use_cpu=True)


def sp_config(sp_size: int, **sizes):
    from accelerate import ParallelismConfig

    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp_size, **sizes)


AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto"}


def test_parallelism_config_fills_sequence_parallel_size_and_the_triad(world_of_4):
    args = world_of_4
    args.parallelism_config = sp_config(2)
    for given in ({**AUTO, "sequence_parallel_size": "auto"}, AUTO):
        cfg = HfTrainerDeepShardConfig(given)
        cfg.trainer_config_process(args)
        assert cfg.sequence_parallel_size == 2 and cfg.config["sequence_parallel_size"] == 2
        assert cfg.config["train_batch_size"] == 2 * 3 * 2  # 2 replicas of 2 ranks
    args.parallelism_config = None
    cfg = HfTrainerDeepShardConfig({**AUTO, "sequence_parallel_size": 2})
    cfg.trainer_config_process(args)
    assert cfg.sequence_parallel_size == 2 and cfg.config["train_batch_size"] == 12


def test_disagreeing_or_unsupported_parallelism_config_is_one_line(world_of_4):
    args = world_of_4
    args.parallelism_config = sp_config(2)
    cfg = HfTrainerDeepShardConfig({**AUTO, "sequence_parallel_size": 4})
    cfg.trainer_config_process(args)
    with pytest.raises(UsageError, match=r"sequence_parallel_size=4 but TrainingArguments "
                                         r"parallelism_config\.sp_size=2"):
        cfg.raise_mismatches()
    args.parallelism_config = sp_config(1, tp_size=2)
    with pytest.raises(UsageError, match="tp_size=2") as info:
        HfTrainerDeepShardConfig(AUTO).trainer_config_process(args)
    assert "\n" not in str(info.value)
