"""Sums a padded flat buffer into each rank's shard with both of ``zero.comm``'s
collectives (all-reduce, as on gloo, and reduce-scatter, as on NCCL) and prints, per rank,
what each left in the shard next to the sum computed locally; one RESULT line per rank."""

import json

import torch
import torch.distributed as dist

import deepshard
from deepshard.runtime.zero.comm import reduce_by_all_reduce, reduce_into_shard

deepshard.init_distributed()
world, rank = dist.get_world_size(), dist.get_rank()
shard = 5
padded = shard * world


def values(r: int) -> torch.Tensor:
    """Rank ``r``'s buffer: distinct per rank and element."""
    return torch.arange(padded, dtype=torch.float32) * (r + 1) + 0.25 * r


want = sum(values(r) for r in range(world))[rank * shard:(rank + 1) * shard]
got = {}
for all_reduce in (True, False):
    buf = values(rank)
    reduce_into_shard(buf, rank * shard, (rank + 1) * shard, None, all_reduce).wait()
    got["all_reduce" if all_reduce else "reduce_scatter"] = buf[rank * shard:(rank + 1) * shard]
print("RESULT " + json.dumps({
    "rank": rank, "gloo_all_reduces": reduce_by_all_reduce(None), "want": want.tolist(),
    **{k: v.tolist() for k, v in got.items()}}), flush=True)
dist.destroy_process_group()
