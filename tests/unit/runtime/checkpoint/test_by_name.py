"""Reading a ZeRO checkpoint by name: the whole of it, or only what one rank keeps."""

from __future__ import annotations

import torch

from deepshard.runtime import checkpoint as ckpt
from deepshard.runtime.checkpoint import by_name as zsave

# one flat group of three parameters (a: 3, b: 4, c: 2 elements, offsets 0, 3, 7) cut
# into two shards of 5: rank 0 holds a and b[:2], rank 1 b[2:], c and one pad element
FLAT = torch.arange(1.0, 10.0)
NAMES, OFFSETS, NUMELS, SHAPES = ["a", "b", "c"], [0, 3, 7], [3, 4, 2], [(3,), (2, 2), (2,)]


def _write(tmp_path) -> ckpt.Manifest:
    padded = torch.cat([FLAT, torch.zeros(1)])
    for rank, (lo, hi) in enumerate([(0, 5), (5, 10)]):
        entry = {"names": NAMES, "offsets": OFFSETS, "numels": NUMELS, "shapes": SHAPES,
                 "lo": lo, "hi": hi, "values": padded[lo:hi].clone(),
                 "state": {"exp_avg": -padded[lo:hi].clone()},
                 "scalars": {"step": torch.tensor(7.0)}}
        torch.save({"zero": [entry]}, tmp_path / ckpt.rank_file(rank))
    return ckpt.Manifest(tag="t", world_size=2, zero_stage=3, param_dtype="float32",
                         master_dtype=None, global_steps=7, deepshard_version="0",
                         files=())


def _whole(name: str) -> torch.Tensor:
    i = NAMES.index(name)
    return FLAT[OFFSETS[i]:OFFSETS[i] + NUMELS[i]].reshape(SHAPES[i])


def test_everything_is_assembled_without_a_need(tmp_path):
    manifest = _write(tmp_path)
    out = zsave.read_by_name(tmp_path, manifest, {"module": {"buf": torch.ones(2)},
                                                  "aliases": {"tied": "c"}})
    assert out.present == {"a", "b", "c", "buf", "tied"}
    for name in NAMES:
        assert torch.equal(out.values[name], _whole(name))
        assert torch.equal(out.state[name]["exp_avg"], -_whole(name))
        assert float(out.scalars[name]["step"]) == 7.0
    assert torch.equal(out.values["tied"], _whole("c"))


def test_a_need_limits_what_is_assembled_but_not_what_is_known_present(tmp_path):
    manifest = _write(tmp_path)
    need = zsave.Needed(values=frozenset({"b"}), state=frozenset({"b", "c"}))
    out = zsave.read_by_name(tmp_path, manifest, {"module": {}}, need=need)
    assert out.present == {"a", "b", "c"}
    assert set(out.values) == {"b"}  # b spans both shard files
    assert torch.equal(out.values["b"], _whole("b"))
    assert set(out.state) == {"b", "c"} and set(out.scalars) == {"b", "c"}
    assert torch.equal(out.state["c"]["exp_avg"], -_whole("c"))
