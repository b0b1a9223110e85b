"""DeepSpeed 0.19.8's checkpoint files read without DeepSpeed (``ds_files``,
``from_deepspeed``): consolidation of every fixture equals the fp32 weights DeepSpeed
reported at the save, in DeepSpeed's key order; the frozen parameter is found at every
stage; DeepSpeed's own classes in the files read as stand-ins; a damaged directory is one
line naming the file and what is missing."""

from __future__ import annotations

import shutil

import pytest
import torch

from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import ds_files, from_deepspeed
from deepshard.runtime.checkpoint.zero_to_fp32 import (
    get_fp32_state_dict_from_zero_checkpoint,
    get_model_state_file,
    get_optim_files,
)
from tests.helpers import ROOT

DATA = ROOT / "tests" / "data" / "deepspeed_checkpoints"
CASES = [f"zero{s}_{p}" for s in range(4) for p in ("fp32", "bf16")]
ORDER = ["offset", "scale.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


@pytest.mark.parametrize("case", CASES)
def test_consolidates_to_deepspeeds_weights(case):
    want = torch.load(DATA / case / "expected.pt", weights_only=False)["at_save"]
    got = get_fp32_state_dict_from_zero_checkpoint(DATA / case / "ckpt")
    assert list(got) == ORDER
    assert all(v.dtype == torch.float32 for v in got.values())
    for name, value in want.items():
        assert torch.equal(got[name], value), (case, name)
    # the buffer is the module's, untouched
    assert torch.equal(got["offset"], torch.linspace(-1, 1, 4))
    lean = get_fp32_state_dict_from_zero_checkpoint(DATA / case / "ckpt", tag="global_step2",
                                                     exclude_frozen_parameters=True)
    # stage 0 trains everything it holds apart: DeepSpeed records no frozen names there
    dropped = set(got) - set(lean)
    assert dropped == (set() if case.startswith("zero0") else {"scale.weight"})


def test_rank_files_and_stand_ins():
    tag = DATA / "zero2_bf16" / "ckpt" / "global_step2"
    optim = get_optim_files(DATA / "zero2_bf16" / "ckpt")
    assert [p.rsplit("/", 1)[1] for p in optim] == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert get_model_state_file(tag, 2).endswith("mp_rank_00_model_states.pt")
    inner = ds_files.load(tag / optim[0].rsplit("/", 1)[1])["optimizer_state_dict"]
    assert inner["zero_stage"].ds_class == "deepspeed.runtime.zero.config.ZeroStageEnum"
    assert inner["zero_stage"].value == 2
    assert inner["loss_scaler"].cur_scale == 1.0
    assert inner["param_slice_mappings"][0]["fc1.weight"].numel == 106


def _copy(case, tmp_path):
    dst = tmp_path / case
    shutil.copytree(DATA / case / "ckpt", dst)
    return dst, dst / "global_step2"


def test_missing_rank_file_is_one_line(tmp_path):
    root, tag = _copy("zero3_fp32", tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(UsageError) as err:
        from_deepspeed.read(tag)
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in str(err.value)
    assert str(tag) in str(err.value) and "\n" not in str(err.value)
    (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(UsageError, match=r"zero_pp_rank_0_mp_rank_00_model_states\.pt is "
                                         "missing"):
        get_fp32_state_dict_from_zero_checkpoint(root)


def test_files_of_two_world_sizes_are_refused(tmp_path):
    _, tag = _copy("zero2_fp32", tmp_path)
    shutil.copy(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    with pytest.raises(UsageError, match="3 optimizer partition files for a world of 2"):
        from_deepspeed.read(tag)


def test_truncated_file_names_itself(tmp_path):
    _, tag = _copy("zero1_fp32", tmp_path)
    victim = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:200])
    with pytest.raises(UsageError) as err:
        from_deepspeed.read(tag)
    assert str(victim) in str(err.value)


def test_client_state_is_what_deepspeed_returns():
    loaded = from_deepspeed.read(DATA / "zero0_fp32" / "ckpt" / "global_step2")
    client = from_deepspeed.client_state(loaded.top, True, True)
    assert client["epoch"] == 3
    assert not {"module", "optimizer", "lr_scheduler", "global_steps"} & set(client)
    assert "lr_scheduler" in from_deepspeed.client_state(loaded.top, True, False)


def test_tensor_parallel_ranks_are_refused(tmp_path):
    _, tag = _copy("zero0_fp32", tmp_path)
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    with pytest.raises(UsageError, match="2 model-parallel"):
        from_deepspeed.read(tag)


def test_an_optimizer_deepshard_lacks_is_named():
    tag = DATA / "zero2_fp32" / "ckpt" / "global_step2"
    top = dict(from_deepspeed.read(tag).top)
    from_deepspeed.check_optimizer(top, tag)  # AdamW: carried over
    top["ds_config"] = {**top["ds_config"], "optimizer": {"type": "Muon", "params": {}}}
    with pytest.raises(UsageError, match="optimizer 'Muon', which deepshard does not have") \
            as err:
        from_deepspeed.check_optimizer(top, tag)
    assert "load_optimizer_states=False" in str(err.value.hint)
