"""Rank 1 starts an all-reduce on a group of its own that no peer ever joins, then raises
(a rank failing mid-step with a collective in flight); rank 0 waits in a barrier that rank
1 never reaches. The job must end with rank 1's error, not hang in rank 1's teardown."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import deepshard

if __name__ == "__main__":
    deepshard.init_distributed(verbose=False)
    lonely = dist.new_group([0, 1])
    if dist.get_rank() == 1:
        work = dist.all_reduce(torch.ones(8), group=lonely, async_op=True)
        print("IN_FLIGHT", flush=True)
        raise RuntimeError("rank 1 failed mid-step")
    dist.barrier()
    sys.exit(3)  # not reached: rank 1 never joins the barrier
