"""Joins the group with deepshard.init_distributed() and checks collectives against
values computed locally; prints one RESULT line per rank."""

import json
import os

import torch
import torch.distributed as dist

import deepshard

env = deepshard.init_distributed()
again = deepshard.init_distributed()  # idempotent: same answer, no second group
world, rank = dist.get_world_size(), dist.get_rank()
summed = torch.tensor([float(rank + 1)])
dist.all_reduce(summed)
gathered = [torch.zeros(1) for _ in range(world)]
dist.all_gather(gathered, torch.tensor([float(rank * rank)]))
print("RESULT " + json.dumps({
    "rank": rank, "world": world, "env_rank": env.rank, "local_rank": env.local_rank,
    "source": env.source, "again": again == env, "backend": dist.get_backend(),
    "sum": summed.item(), "gathered": [t.item() for t in gathered],
    "pid": os.getpid(),
}), flush=True)
dist.destroy_process_group()
