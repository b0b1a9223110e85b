"""DeepSpeed 0.19.8's pipeline and MoE checkpoints read without DeepSpeed (``ds_files``,
``ds_parallel``, ``from_deepspeed``): ``pipe2_zero{0,1}`` (a 2-stage ``PipelineModule``)
and ``moe_ep2_zero{0,2}`` (4 experts at ``ep_size`` 2) consolidate to the fp32 weights
DeepSpeed reported at the save, every expert once under its global id, in module order; an
incomplete directory is one line naming the missing layer, stage, expert or optimizer file;
what is not read (tensor-parallel files, pipelines with MoE layers, optimizer state of
fp16 / bf16 pipeline stages without ZeRO) is refused in one line."""

from __future__ import annotations

import shutil

import pytest
import torch

from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import ds_files, ds_parallel, from_deepspeed, universal
from deepshard.runtime.checkpoint.zero_to_fp32 import (
    get_fp32_state_dict_from_zero_checkpoint,
    get_optim_files,
)
from tests.helpers import ROOT

DATA = ROOT / "tests" / "data" / "deepspeed_checkpoints"
PIPE = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts.{}.{}"
MOE = ["inp.weight", "inp.bias", "moe.deepspeed_moe.gate.wg.weight",
       *(EXPERT.format(e, k) for e in range(4)
         for k in ("0.weight", "0.bias", "2.weight", "2.bias")), "out.weight", "out.bias"]


@pytest.mark.parametrize("case", ["pipe2_zero0", "pipe2_zero1", "moe_ep2_zero0",
                                  "moe_ep2_zero2"])
def test_consolidates_to_deepspeeds_weights(case):
    want = torch.load(DATA / case / "expected.pt", weights_only=False)["at_save"]
    got = get_fp32_state_dict_from_zero_checkpoint(DATA / case / "ckpt")
    assert list(got) == (PIPE if case.startswith("pipe") else MOE)
    for name, value in want.items():
        assert torch.equal(got[name], value), (case, name)
    lean = get_fp32_state_dict_from_zero_checkpoint(DATA / case / "ckpt",
                                                     exclude_frozen_parameters=True)
    assert list(lean) == list(got)  # nothing is frozen


def test_optimizer_state_is_read_by_global_name():
    pipe = from_deepspeed.read(DATA / "pipe2_zero0" / "ckpt" / "global_step2").by_name
    assert sorted(pipe.state) == sorted(PIPE)
    assert pipe.state["4.weight"]["exp_avg"].shape == (4, 16)
    assert float(pipe.scalars["2.bias"]["step"]) == 2.0
    for case in ("moe_ep2_zero0", "moe_ep2_zero2"):
        moe = from_deepspeed.read(DATA / case / "ckpt" / "global_step2").by_name
        assert sorted(moe.state) == sorted(MOE), case
        # DeepSpeed saves expert-parallel rank 1's experts under local ids 0-1
        assert not torch.equal(moe.state[EXPERT.format(1, "0.weight")]["exp_avg"],
                               moe.state[EXPERT.format(3, "0.weight")]["exp_avg"])


def test_optimizer_files_of_every_stage_and_expert_rank():
    names = [p.rsplit("/", 1)[1] for p in get_optim_files(DATA / "pipe2_zero1" / "ckpt")]
    assert names == ["zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_0_mp_rank_01_optim_states.pt"]
    names = [p.rsplit("/", 1)[1] for p in get_optim_files(DATA / "moe_ep2_zero0" / "ckpt")]
    assert names == ["expp_rank_0_mp_rank_00_optim_states.pt",
                     "expp_rank_1_mp_rank_00_optim_states.pt"]


def _copy(case, tmp_path):
    dst = tmp_path / case
    shutil.copytree(DATA / case / "ckpt", dst)
    return dst / "global_step2"


@pytest.mark.parametrize(("case", "victim", "said"), [
    ("pipe2_zero1", "layer_02-model_states.pt", "layer_02-model_states.pt is missing"),
    ("pipe2_zero1", "mp_rank_01_model_states.pt", "mp_rank_01_model_states.pt is missing"),
    ("pipe2_zero0", "mp_rank_01_model_states.pt", "mp_rank_01_model_states.pt is missing"),
    ("pipe2_zero1", "zero_pp_rank_0_mp_rank_01_optim_states.pt",
     "zero_pp_rank_0_mp_rank_01_optim_states.pt is missing"),
    ("moe_ep2_zero2", "layer_0_expert_3_mp_rank_00_model_states.pt",
     "layer_0_expert_3_mp_rank_00_model_states.pt is missing"),
    ("moe_ep2_zero2", "layer_0_expert_1_mp_rank_00_model_states.pt",
     "layer_0_expert_1_mp_rank_00_model_states.pt is missing"),
    ("moe_ep2_zero0", "expp_rank_1_mp_rank_00_optim_states.pt",
     "expp_rank_1_mp_rank_00_optim_states.pt is missing"),
])
def test_a_missing_file_is_named_in_one_line(tmp_path, case, victim, said):
    tag = _copy(case, tmp_path)
    (tag / victim).unlink()
    with pytest.raises(UsageError) as err:
        from_deepspeed.read(tag)
    assert said in str(err.value) and str(tag) in str(err.value)
    assert "\n" not in str(err.value)


def test_what_is_not_read_is_refused_in_one_line(tmp_path):
    tag = _copy("pipe2_zero1", tmp_path)
    shutil.copy(tag / "layer_00-model_states.pt", tag / "layer_00-model_01-model_states.pt")
    with pytest.raises(UsageError, match="tensor-parallel"):
        from_deepspeed.read(tag)
    tag = _copy("moe_ep2_zero2", tmp_path)
    (tag / "layer_0_expert_0_mp_rank_00_model_states.pt").rename(
        tag / "expert_0_mp_rank_00_model_states.pt")
    with pytest.raises(UsageError, match=r"older than 0\.5"):
        from_deepspeed.read(tag)
    pipe = _copy("pipe2_zero0", tmp_path)
    shutil.copy(tag / "layer_0_expert_1_mp_rank_00_model_states.pt",
                pipe / "layer_0_expert_0_mp_rank_00_model_states.pt")
    with pytest.raises(UsageError, match="pipeline checkpoints with MoE layers"):
        from_deepspeed.read(pipe)


def test_optimizer_state_kept_by_a_wrapper_is_refused_naming_the_file(tmp_path):
    """fp16 / bf16 pipeline stages without ZeRO keep their state in DeepSpeed's wrapper
    (flat fp32 groups): not named, so loading it is refused; the weights still read."""
    tag = _copy("pipe2_zero0", tmp_path)
    path = tag / "mp_rank_01_model_states.pt"
    top = dict(ds_files.load(path, mmap=False))
    top["optimizer"] = {"optimizer_state_dict": top["optimizer"], "fp32_groups_flat": []}
    torch.save(top, path)
    loaded = from_deepspeed.read(tag)
    assert loaded.unread_optimizer == path
    assert sorted(loaded.by_name.values) == sorted(PIPE)
    with pytest.raises(UsageError) as err:
        from_deepspeed.check_optimizer_read(loaded)
    assert str(path) in str(err.value) and "load_optimizer_states=False" in err.value.hint
    from_deepspeed.check_optimizer_read(from_deepspeed.read(DATA / "pipe2_zero1" / "ckpt" /
                                                           "global_step2"))


@pytest.mark.parametrize("case", ["pipe2_zero1", "moe_ep2_zero2"])
def test_universal_conversion_is_refused(tmp_path, case):
    with pytest.raises(UsageError, match="not converted to universal"):
        universal.convert(DATA / case / "ckpt" / "global_step2", tmp_path / "out")


def test_expert_names():
    group = {"a": (2,), EXPERT.format(0, "w"): (3,), EXPERT.format(1, "w"): (3,)}
    assert list(ds_parallel.global_names(group, 1)) == [
        "a", EXPERT.format(2, "w"), EXPERT.format(3, "w")]
    assert ds_parallel.expert_parallel_size({"name": "ep_size_4", "moe": True}) == 4
    assert ds_parallel.expert_parallel_size({"name": "dense-params"}) == 1
    assert list(ds_parallel.partition_ranks(2, 1, 6)) == [1, 3, 5]
    values = {EXPERT.format(e, "w"): torch.zeros(1) for e in range(4)}
    assert list(ds_parallel.rank_experts(values, 2, 1)) == [EXPERT.format(2, "w"),
                                                            EXPERT.format(3, "w")]
    order = ["inp.w", "moe.deepspeed_moe.gate.wg.weight", "out.w"]
    assert ds_parallel.with_experts(order, [EXPERT.format(0, "w")]) == [
        "inp.w", "moe.deepspeed_moe.gate.wg.weight", EXPERT.format(0, "w"), "out.w"]
