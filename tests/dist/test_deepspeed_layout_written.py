"""``checkpoint.format: "deepspeed"``: deepshard trains the fixture model of
``tests/data/deepspeed_checkpoints`` on 2 ranks (ZeRO 0-3, fp32; ZeRO 1 and 3, bf16) and
saves in DeepSpeed's own layout. The files are DeepSpeed 0.19.8's, key for key: the same
names, the same tensors' shapes and dtypes, the same partition bookkeeping (paddings,
partition counts, fragment addresses, parameter shapes) as the files DeepSpeed wrote for
the same model and config. deepshard loads them at 1 and 4 ranks at other stages and
continues equal to its own uninterrupted run (fp32 1e-6, bf16 1e-3). That DeepSpeed
itself resumes them is ``test_deepspeed_checkpoint_back.py`` (with the side venv).
A job whose state the layout cannot hold is refused in one line, before writing."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import ds_files
from tests.dist.ds_resume import SCRIPT, check_continued, resumed
from tests.helpers import ROOT, run_ds

DATA = ROOT / "tests" / "data" / "deepspeed_checkpoints"
CASES = ["zero0_fp32", "zero1_fp32", "zero2_fp32", "zero3_fp32", "zero1_bf16", "zero3_bf16"]
PLANS = {1: [3, 3, 3, 1, 2, 2], 4: [1, 2, 0, 2, 3, 1]}
# deepshard's own: its scheduler's state holds more than DeepSpeed's (which reads
# last_batch_iteration), its optimizer groups' hyperparameters are its optimizer's
LOOSE = ("lr_scheduler", "param_groups", "ds_config", "ds_version")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("deepspeed_layout")
    done = run_ds("--num_gpus", "2", SCRIPT, "save-deepspeed", str(root), *CASES,
                  timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def _form(value: object, key: str = "") -> object:
    """What must agree between two files: structure, exact bookkeeping, tensors' shapes
    and dtypes (the values differ: two trainings)."""
    if key in LOOSE:
        return type(value).__name__
    if isinstance(value, ds_files.Foreign):
        attrs = {k: v for k, v in vars(value).items() if k not in ("args", "kwargs")}
        return (value.ds_class, getattr(value, "args", ()), _form(attrs))
    if isinstance(value, Mapping):
        return {str(k): _form(v, str(k)) for k, v in value.items()}
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, (list, tuple)):
        return [_form(v) for v in value]
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, float):
        return "float"
    return value


@pytest.mark.parametrize("case", CASES)
def test_files_are_deepspeeds(written, case):
    ours, theirs = written / case / "ckpt" / "global_step2", DATA / case / "ckpt" / "global_step2"
    names = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names
    assert (written / case / "ckpt" / "latest").read_text() == "global_step2"
    for name in names:
        got, want = ds_files.load(ours / name), ds_files.load(theirs / name)
        assert _form(got) == _form(want), name


@pytest.mark.parametrize("ranks", sorted(PLANS))
def test_deepshard_resumes_them_anywhere(written, ranks, tmp_path):
    plan = [(f"written:{written / case}", stage)
            for case, stage in zip(CASES, PLANS[ranks], strict=True)]
    for rank, results in resumed(ranks, tmp_path, plan).items():
        for key, got in results.items():
            check_continued(got, f"{key} rank {rank} of {ranks}")


def test_four_ranks_partitions_reach_into_the_next_shard(tmp_path):
    """At 4 ranks the fixture model's 212 trainable elements pad to 216 in DeepSpeed's
    groups (2 × world) but 212 in deepshard's: each DeepSpeed partition takes the first
    elements of the next rank's shard. The consolidated weights are the run's, and 2
    ranks continue it as the run itself did."""
    from deepshard.runtime.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    cases = ["zero1_fp32", "zero2_bf16"]
    done = run_ds("--num_gpus", "4", SCRIPT, "save-deepspeed", str(tmp_path), *cases,
                  timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for case in cases:
        tag = tmp_path / case / "ckpt" / "global_step2"
        optim = ds_files.load(tag / ds_files.optim_file(3, bf16="bf16" in case))
        assert optim["optimizer_state_dict"]["group_paddings"] == [4]
        weights = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / case / "ckpt"))
        want = torch.load(tmp_path / case / "expected.pt", weights_only=False)["at_save"]
        assert all(torch.equal(weights[k].float(), want[k]) for k in want), case
    plan = [(f"written:{tmp_path / case}", 2) for case in cases]
    for rank, results in resumed(2, tmp_path / "scratch", plan, timeout=300).items():
        for key, got in results.items():
            check_continued(got, f"{key} rank {rank} of 2")


def test_a_job_the_layout_cannot_hold_is_refused(one_rank_group, tmp_path):
    import deepshard

    model = torch.nn.Linear(4, 2)
    cfg = {"train_batch_size": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "checkpoint": {"format": "deepspeed"}}
    engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    with pytest.raises(UsageError, match="bf16 job at ZeRO stage 0") as err:
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert err.value.where == "checkpoint.format" and "ds_to_universal" in err.value.hint
    assert not (tmp_path / "ckpt").exists()


def test_the_format_key_is_checked(one_rank_group):
    import deepshard

    model = torch.nn.Linear(4, 2)
    with pytest.raises(UsageError, match=r"checkpoint\.format"):
        deepshard.initialize(model=model, model_parameters=model.parameters(),
                             config={"train_batch_size": 1,
                                     "checkpoint": {"format": "megatron"}})
