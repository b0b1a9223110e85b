"""``BlockReader`` (inference's view of a training checkpoint): on deepshard checkpoints
of ZeRO stages 0 and 3 (fp32 and bf16 with fp32 masters) and on DeepSpeed 0.19.8's, every
name, shape and value equals ``get_fp32_state_dict``'s; one block at a time is held, and
dropping it unmaps the checkpoint's files; a directory without a checkpoint or an unknown
name is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import deepshard
from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import format as fmt
from deepshard.runtime.checkpoint.consolidate import get_fp32_state_dict
from deepshard.runtime.checkpoint.inference_reader import BlockReader, block_of
from tests.helpers import ROOT

DATA = ROOT / "tests" / "data" / "deepspeed_checkpoints"


class Net(nn.Module):
    """Two blocks in a ModuleList, a tied embedding / head, a non-float buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4)) for _ in range(2))
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("index", torch.arange(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def train_and_save(save_dir: Path, stage: int, bf16: bool = False) -> Path:
    torch.manual_seed(0)
    config = {"train_batch_size": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepshard.initialize(model=Net(), config=config)
    engine.backward(engine(torch.randint(0, 8, (1, 3))).float().square().mean())
    engine.step()
    engine.save_checkpoint(save_dir)
    return save_dir


@pytest.fixture(params=[(0, False), (3, True)], ids=["stage0", "stage3-bf16"])
def checkpoint(request: pytest.FixtureRequest, tmp_path: Path, one_rank_group: None) -> Path:
    return train_and_save(tmp_path / "ckpt", *request.param)


def split_over_two_ranks(save_dir: Path) -> None:
    """A one-rank ZeRO checkpoint rewritten as a two-rank one: each flat group's shard
    cut in half, the second half in a new rank file (what two ranks would have saved)."""
    tag_dir = save_dir / "global_step1"
    own = torch.load(tag_dir / fmt.rank_file(0), weights_only=False)
    halves: list[list[dict]] = [[], []]
    for e in own["zero"]:
        cut = (e["hi"] - e["lo"]) // 2
        for half, (lo, hi), part in ((0, (e["lo"], e["lo"] + cut), slice(None, cut)),
                                     (1, (e["lo"] + cut, e["hi"]), slice(cut, None))):
            halves[half].append({**e, "lo": lo, "hi": hi, "values": e["values"][part],
                                 "state": {k: v[part] for k, v in e["state"].items()}})
    for rank, entries in enumerate(halves):
        torch.save({**own, "zero": entries}, tag_dir / fmt.rank_file(rank))
    manifest = json.loads((tag_dir / fmt.MANIFEST).read_text())
    manifest.update(world_size=2, files=[fmt.SHARED_FILE, fmt.rank_file(0), fmt.rank_file(1)])
    (tag_dir / fmt.MANIFEST).write_text(json.dumps(manifest))


def assert_same_as_consolidated(reader: BlockReader, want: dict[str, torch.Tensor]) -> None:
    assert reader.names() == list(want)
    for name, value in want.items():
        assert reader.shape(name) == tuple(value.shape), name
    for name, value in want.items():
        got = reader.value(name)
        assert got.dtype == value.dtype, name
        assert torch.equal(got, value), name


def test_equals_the_consolidated_state(checkpoint: Path) -> None:
    reader = BlockReader(checkpoint)
    want = get_fp32_state_dict(checkpoint)
    assert want["blocks.0.0.weight"].dtype == torch.float32
    assert want["index"].dtype == torch.int64
    assert_same_as_consolidated(reader, want)
    assert torch.equal(reader.value("head.weight"), want["emb.weight"])  # tied


def test_a_block_reads_only_the_ranks_holding_it(tmp_path: Path, one_rank_group: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    save_dir = train_and_save(tmp_path / "ckpt", 3)
    split_over_two_ranks(save_dir)
    want = get_fp32_state_dict(save_dir)
    reader = BlockReader(save_dir)
    opened: list[str] = []
    load = fmt.load_file

    def spy(tag_dir: Path, name: str, mmap: bool = False) -> dict:
        opened.append(name)
        return load(tag_dir, name, mmap=mmap)

    monkeypatch.setattr(fmt, "load_file", spy)
    assert_same_as_consolidated(reader, want)
    # in the flat group's order: norm.* and blocks.1 in rank 0's half, blocks.0 cut in
    # two, emb.weight (and its alias head.weight) in rank 1's half
    ranks = {}
    for name in ("norm.weight", "blocks.1.0.weight", "blocks.0.2.weight", "head.weight"):
        opened.clear()
        reader.value(name)
        ranks[name] = sorted(n for n in opened if n.startswith("rank_"))
    assert ranks == {"norm.weight": ["rank_00000.pt"], "blocks.1.0.weight": ["rank_00000.pt"],
                     "blocks.0.2.weight": ["rank_00000.pt", "rank_00001.pt"],
                     "head.weight": ["rank_00001.pt"]}


def test_a_model_parallel_checkpoint_is_consolidated_once(tmp_path: Path,
                                                          one_rank_group: None) -> None:
    # a stage 0 checkpoint recast as one of a 1x1x1 layout: every rank's file then holds
    # its own module state ("mp"), as a pipeline / tensor-parallel job writes it
    save_dir = train_and_save(tmp_path / "ckpt", 0)
    tag_dir = save_dir / "global_step1"
    shared = torch.load(tag_dir / fmt.SHARED_FILE, weights_only=False)
    own = torch.load(tag_dir / fmt.rank_file(0), weights_only=False)
    torch.save({**own, "mp": {**shared, "tp_layout": {}}}, tag_dir / fmt.rank_file(0))
    manifest = json.loads((tag_dir / fmt.MANIFEST).read_text())
    manifest["layout"] = {"pipe": 1, "data": 1, "tensor": 1}
    (tag_dir / fmt.MANIFEST).write_text(json.dumps(manifest))
    want = get_fp32_state_dict(save_dir)
    assert_same_as_consolidated(BlockReader(save_dir), want)


def test_one_block_is_held(checkpoint: Path) -> None:
    reader = BlockReader(checkpoint, tag="global_step1")
    reader.value("blocks.0.2.bias")
    assert set(reader.held) == {f"blocks.0.{i}.{k}" for i in (0, 2) for k in ("weight", "bias")}
    reader.value("blocks.1.0.weight")
    assert sorted(reader.held) == [f"blocks.1.{i}.{k}" for i in (0, 2) for k in ("bias", "weight")]
    reader.value("norm.weight")
    assert list(reader.held) == ["norm.weight"]
    reader.drop()
    assert not reader.held


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_dropping_a_block_unmaps_the_files(checkpoint: Path) -> None:
    def mapped() -> set[str]:
        with open("/proc/self/maps") as f:
            return {line.split()[-1] for line in f if str(checkpoint) in line}

    reader = BlockReader(checkpoint)
    assert not mapped()  # opening read metadata only, and kept no file mapped
    value = reader.value("blocks.1.2.weight")
    del value
    assert mapped()
    reader.drop()
    assert not mapped()


def test_no_checkpoint_and_unknown_names_are_one_line(tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(UsageError, match="no complete checkpoint") as err:
        BlockReader(tmp_path / "nothing")
    assert str(tmp_path / "nothing") in str(err.value) and "HINT" in str(err.value)
    with pytest.raises(UsageError, match="no complete checkpoint with tag"):
        BlockReader(checkpoint, tag="global_step9")
    with pytest.raises(UsageError, match=r"holds no 'blocks\.7\.0\.weight'"):
        BlockReader(checkpoint).shape("blocks.7.0.weight")


@pytest.mark.parametrize("case", ["zero3_bf16", "zero2_fp32", "pipe2_zero1", "moe_ep2_zero2"])
def test_deepspeed_checkpoints(case: str) -> None:
    reader = BlockReader(DATA / case / "ckpt")
    assert_same_as_consolidated(reader, get_fp32_state_dict(DATA / case / "ckpt"))
    last = reader.names()[-1]
    reader.value(last)
    assert {block_of(n) for n in reader.held} == {block_of(last)}


def test_block_of() -> None:
    assert block_of("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert block_of("moe.deepspeed_moe.experts.deepspeed_experts.5.0.bias") == \
        "moe.deepspeed_moe.experts.deepspeed_experts.5"
    assert block_of("4.bias") == "4"
    assert block_of("lm_head.weight") == "lm_head.weight"
