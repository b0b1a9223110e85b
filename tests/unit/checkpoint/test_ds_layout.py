"""Where DeepSpeed 0.19.8 keeps each parameter in its ZeRO partitions
(:mod:`deepshard.runtime.checkpoint.ds_layout`), checked against the bookkeeping DeepSpeed
wrote into the fixtures (``group_paddings``, ``param_slice_mappings``, flat sizes) and
against its rules where the fixtures do not reach (alignment padding, groups smaller than
the world, sub-groups); and the pickling of DeepSpeed's classes without DeepSpeed."""

from __future__ import annotations

import zipfile

import pytest
import torch

from deepshard.runtime.checkpoint import ds_files, ds_layout, ds_pickle
from tests.helpers import ROOT

DATA = ROOT / "tests" / "data" / "deepspeed_checkpoints"
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
NUMELS = [128, 16, 64, 4]


@pytest.mark.parametrize("rank", [0, 1])
def test_stage12_matches_deepspeeds_files(rank):
    part = ds_layout.stage12(NAMES, NUMELS, 2, rank, 0)
    saved = ds_files.load(DATA / "zero2_fp32" / "ckpt" / "global_step2" /
                          ds_files.optim_file(rank))["optimizer_state_dict"]
    assert part.padding == saved["group_paddings"][0]
    assert list(part.paddings) == saved["param_alignment_paddings"][0]
    assert part.size - part.padding == saved["single_partition_of_fp32_groups"][0].numel()
    fragments = {}
    for k, (at, n) in enumerate(zip(part.offsets, part.numels, strict=True)):
        lo, hi = max(at, part.start), min(at + n, part.start + part.size)
        if lo < hi:
            fragments[NAMES[k]] = (hi - lo, lo - part.start)
    want = {n: (a.numel, a.start) for n, a in saved["param_slice_mappings"][0].items()}
    assert fragments == want


def test_stage12_pads_the_group_to_twice_the_world():
    # 7 elements over 4 ranks: aligned to 8, 2 per rank; the last rank holds 1 + 1 padding
    parts = [ds_layout.stage12(["a", "b"], [3, 4], 4, r, 0) for r in range(4)]
    assert [p.size for p in parts] == [2, 2, 2, 2]
    assert [p.padding for p in parts] == [0, 0, 0, 1]
    # 2 elements over 4 ranks: ranks 1-3 hold nothing but padding
    tiny = [ds_layout.stage12(["a"], [2], 4, r, 0) for r in range(4)]
    assert [p.padding for p in tiny] == [0, 2, 2, 2]


def test_parameter_alignment_pads_each_member_but_the_last():
    part = ds_layout.stage12(["a", "b", "c"], [3, 5, 2], 1, 0, 0, element_size=2,
                             parameter_alignment=True)
    assert part.paddings == (5, 3, 0)  # 16 bytes of bf16: multiples of 8 elements
    assert part.offsets == (0, 8, 16)


def test_stage3_pieces_and_sub_groups():
    (whole,) = ds_layout.stage3(NAMES, NUMELS, 2, 0)
    saved = ds_files.load(DATA / "zero3_fp32" / "ckpt" / "global_step2" /
                          ds_files.optim_file(0))["optimizer_state_dict"]
    assert whole.size == saved["fp32_flat_groups"][0].numel()
    assert whole.offsets == (0, 64, 72, 104)
    subs = ds_layout.stage3(NAMES, NUMELS, 2, 1, sub_group_size=70)
    assert [s.names for s in subs] == [("fc1.weight", "fc1.bias"), ("fc2.weight", "fc2.bias")]
    assert [s.size for s in subs] == [72, 34] and {s.group for s in subs} == {1}


def test_deepspeeds_classes_round_trip_without_deepspeed(tmp_path):
    scaler = ds_pickle.instance(ds_pickle.LOSS_SCALER, cur_scale=1.0, dynamic=False)
    stage = ds_pickle.instance(ds_pickle.ZERO_STAGE, 2)
    address = ds_pickle.instance(ds_pickle.FRAGMENT_ADDRESS, numel=22, start=0)
    path = tmp_path / "f.pt"
    torch.save({"s": scaler, "z": stage, "a": [address], "t": torch.ones(2)}, path,
               pickle_module=ds_pickle.pickle_module())
    back = ds_files.load(path)
    assert back["s"].ds_class == ds_pickle.LOSS_SCALER and back["s"].cur_scale == 1.0
    assert back["z"].ds_class == ds_pickle.ZERO_STAGE and back["z"].value == 2
    assert (back["a"][0].numel, back["a"][0].start) == (22, 0)
    assert torch.equal(back["t"], torch.ones(2))
    with zipfile.ZipFile(path) as archive:  # DeepSpeed's classes, by DeepSpeed's names
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    assert b"cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n" in pickled
    assert b"cdeepspeed.runtime.zero.config\nZeroStageEnum\n" in pickled


def test_stage3_pieces_join_only_where_read():
    from deepshard.runtime.checkpoint.ds_partitions import Pieces

    whole = torch.arange(7.0)
    pieces = [whole[0:4], torch.cat([whole[4:7], torch.zeros(1)])]  # 2 ranks, 1 padding
    lazy = Pieces(pieces, 7, (7,))
    flat = lazy.reshape(-1)
    assert torch.equal(flat[2:6], whole[2:6])  # across the two pieces
    assert torch.equal(flat[5:9], whole[5:7])  # the padding is not the parameter's
    assert torch.equal(flat[0:7:2], whole[0:7:2])
    assert lazy.shape == (7,) and lazy.numel() == 7 and lazy.dtype == torch.float32
    assert torch.equal(lazy.view_as(torch.empty(7, 1)), whole.view(7, 1))
    assert torch.equal(lazy.float(), whole)
