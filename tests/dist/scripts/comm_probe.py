"""Runs every deepshard.comm collective next to torch.distributed's on the same tensors,
with the comms logger on, then prints the logger's summary table (rank 0) and one RESULT
line per rank: per op, whether the two agreed, and the logger's counts."""

import json

import torch
import torch.distributed as dist

import deepshard.comm as comm

# torch 2.13's names of the single-tensor gather/scatter (the old ones warn there)
gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

env = comm.init_distributed(verbose=False)
comm.configure(enabled=True, prof_all=True)
rank, world = comm.get_rank(), comm.get_world_size()
peer = (rank + 1) % world
same: dict[str, bool] = {}


def data(n: int = 6, dtype=torch.float32) -> torch.Tensor:
    """Distinct per rank and element."""
    return (torch.arange(n, dtype=torch.float64) * (rank + 1) + 0.5 * rank).to(dtype)


def check(name: str, ours, theirs) -> None:
    ours, theirs = list(ours), list(theirs)
    same[name] = len(ours) == len(theirs) and all(
        torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def in_place(name: str, ours_op, torch_op, n: int = 6) -> None:
    a, b = data(n), data(n)
    ours_op(a)
    torch_op(b)
    check(name, [a], [b])


in_place("all_reduce", comm.all_reduce, dist.all_reduce)
in_place("all_reduce_max", lambda t: comm.all_reduce(t, op=comm.ReduceOp.MAX),
         lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX))
in_place("all_reduce_async", lambda t: comm.all_reduce(t, async_op=True).wait(),
         dist.all_reduce)
in_place("inference_all_reduce", comm.inference_all_reduce, dist.all_reduce)
in_place("reduce", lambda t: comm.reduce(t, 0), lambda t: dist.reduce(t, 0))
in_place("broadcast", lambda t: comm.broadcast(t, 1), lambda t: dist.broadcast(t, 1))

mixed = [data(3), data(2, torch.float64), data(4)]
reference = [t.clone() for t in mixed]
comm.all_reduce_coalesced(mixed)
for t in reference:
    dist.all_reduce(t)
check("all_reduce_coalesced", mixed, reference)

ours, theirs = [torch.empty(6) for _ in range(world)], [torch.empty(6) for _ in range(world)]
comm.all_gather(ours, data())
dist.all_gather(theirs, data())
check("all_gather", ours, theirs)
for name, fn in (("all_gather_into_tensor", comm.all_gather_into_tensor),
                 ("allgather_fn", comm.allgather_fn)):
    ours, theirs = torch.empty(6 * world), torch.empty(6 * world)
    fn(ours, data())
    gather_single(theirs, data())
    check(name, [ours], [theirs])
for name, fn in (("reduce_scatter_tensor", comm.reduce_scatter_tensor),
                 ("reduce_scatter_fn", comm.reduce_scatter_fn)):
    ours, theirs = torch.empty(3), torch.empty(3)
    fn(ours, data(3 * world))
    scatter_single(theirs, data(3 * world))
    check(name, [ours], [theirs])
ours, theirs = torch.empty(3), torch.empty(3)
comm.reduce_scatter(ours, list(data(3 * world).chunk(world)))
dist.reduce_scatter(theirs, list(data(3 * world).chunk(world)))
check("reduce_scatter", [ours], [theirs])
ours, theirs = torch.empty(2 * world), torch.empty(2 * world)
comm.all_to_all_single(ours, data(2 * world))
dist.all_to_all_single(theirs, data(2 * world))
check("all_to_all_single", [ours], [theirs])

# point to point: rank 0 sends, rank 1 receives, then the other way round with isend/irecv
got = torch.zeros(6)
if rank == 0:
    comm.send(data(), 1)
else:
    comm.recv(got, 0)
work = comm.isend(data(), peer) if rank == 1 else comm.irecv(got, 1)
work.wait()
want = (torch.arange(6, dtype=torch.float64) * (1 - rank + 1) + 0.5 * (1 - rank)).float()
same["send_recv_isend_irecv"] = torch.equal(got, want)
got = torch.zeros(6)
for request in comm.batch_isend_irecv([comm.P2POp(comm.isend, data(), peer),
                                       comm.P2POp(comm.irecv, got, peer)]):
    request.wait()
same["batch_isend_irecv"] = torch.equal(got, want)

objects = [{"from": rank}]
comm.broadcast_object_list(objects, 0)
same["broadcast_object_list"] = objects == [{"from": 0}]
gathered = [None] * world
comm.all_gather_object(gathered, rank * 10)
same["all_gather_object"] = gathered == [r * 10 for r in range(world)]

pair = comm.new_group(list(range(world)))
in_place("all_reduce_subgroup", lambda t: comm.all_reduce(t, group=pair),
         lambda t: dist.all_reduce(t, group=pair))
comm.barrier()
comm.monitored_barrier()

stats = comm.log_summary(return_dict=True)
counts = {name: {str(size): row["count"] for size, row in sizes.items()}
          for name, sizes in stats["summary"].items()}

# filters: only ops named in prof_ops, or called with prof=True, are recorded
comm.reset_log()
comm.configure(prof_all=False, prof_ops=["my_all_reduce"])
for _ in range(2):
    comm.all_reduce(data(), log_name="my_all_reduce")
comm.all_reduce(data())
comm.broadcast(data(), 0, prof=True)
filtered = comm.get_logged_comm_ops(), comm.get_comm_operation_count()
comm.reset_log()
comm.configure(prof_all=True, debug=True)
comm.all_reduce(data())
debug_names = comm.get_logged_comm_ops()
comm.configure(enabled=False, debug=False)

print("RESULT " + json.dumps({
    "rank": rank, "world": world, "source": env.source, "backend": comm.get_backend(),
    "local_rank": comm.get_local_rank(), "initialized": comm.is_initialized(),
    "global_rank_of_1": comm.get_global_rank(pair, 1),
    "group_ranks": comm.get_all_ranks_from_group(pair), "same": same, "counts": counts,
    "filtered": filtered, "debug_names": debug_names,
}), flush=True)
comm.destroy_process_group()
