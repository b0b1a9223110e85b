"""qgZ's reduction on the job's ranks: every rank's random buffer summed into its own chunk
through the two quantized levels (nodes of ``argv[1]`` ranks), against the exact sum.
Prints ``RESULT {"err": max error, "bound": the stated bound, "scale": max |x|}``."""

import json
import sys

import torch
import torch.distributed as dist

import deepshard
from deepshard.runtime.zero.qgz import QuantizedReduce, quantized_reduce_into_shard
from deepshard.runtime.zero.subgroups import make_subgroup

deepshard.init_distributed(verbose=False)
rank, world = dist.get_rank(), dist.get_world_size()
per_node = int(sys.argv[-1])  # after --local_rank=N
local = make_subgroup(None, world, rank, per_node) if per_node > 1 else None
cross = make_subgroup(None, world, rank, per_node, strided=True) if per_node < world else None
plan = QuantizedReduce(local, cross)
s = 1000  # not a multiple of the block: the last block of each part is padded
buf = torch.randn(world * s, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
exact = buf.clone()
dist.all_reduce(exact)
scale = buf.abs().max().clone()
dist.all_reduce(scale, op=dist.ReduceOp.MAX)
lo, hi = rank * s, (rank + 1) * s
quantized_reduce_into_shard(buf, lo, hi, plan)
err = float((buf[lo:hi] - exact[lo:hi]).abs().max())
# each level errs by half a step of a block of at most its inputs' magnitude: the first
# level's inputs are at most scale, the second's at most per_node * scale
bound = float(scale) / 254 * (per_node + plan.nodes * per_node)
print("RESULT " + json.dumps({"rank": rank, "err": err, "bound": bound,
                              "relative": err / float(exact[lo:hi].abs().max())}), flush=True)
