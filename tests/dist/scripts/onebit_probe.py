"""1-bit compression on real gloo ranks; prints one RESULT line per rank.

``compressed``: the compressed all-reduce, several calls in a row for a few (odd) sizes,
against ``simulate`` of every rank's inputs (each rank makes all ranks' inputs from the same
seeds), compared exactly: the result and both error buffers; plus the bytes it sent and the
comms logger's records.
"""

import json
import sys

import torch

import deepshard.comm as comm
from deepshard.runtime.optim.onebit.compressed import CompressedAllreduce

SIZES = (1, 37, 200, 1000)
CALLS = 4


def inputs(size: int, call: int, world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * size + call)
    return [torch.randn(size, generator=gen) * (r + 1) for r in range(world)]


def check_compressed(rank: int, world: int) -> dict:
    car = CompressedAllreduce()
    same, nonzero, bytes_sent = {}, {}, {}
    for size in SIZES:
        padded = car.padded_numel(size)
        mine = car.new_errors(size)
        refs = [car.new_errors(size) for _ in range(world)]
        ok, errs = True, True
        for call in range(CALLS):
            xs = inputs(size, call, world)
            buffers = [torch.zeros(padded) for _ in range(world)]
            for b, x in zip(buffers, xs, strict=True):
                b[:size] = x
            buffer = buffers[rank].clone()
            car(buffer, *mine)
            car.simulate(buffers, [w for w, _ in refs], [s for _, s in refs])
            ok = ok and torch.equal(buffer, buffers[rank]) and torch.equal(
                mine[0], refs[rank][0]) and torch.equal(mine[1], refs[rank][1])
            errs = errs and bool(mine[0].abs().sum() > 0) and bool(mine[1].abs().sum() > 0)
        same[str(size)], nonzero[str(size)] = ok, errs
        bytes_sent[str(size)] = [padded, car.last_bytes_sent]
    return {"same": same, "errors_nonzero": nonzero, "bytes": bytes_sent}


def main() -> None:
    comm.init_distributed(verbose=False)
    comm.configure(enabled=True, prof_all=True)
    rank, world = comm.get_rank(), comm.get_world_size()
    result = {"rank": rank, "world": world}
    mode = next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))
    if mode == "compressed":
        result.update(check_compressed(rank, world))
    from deepshard.comm.logger import comms_logger

    result["counts"] = {name: {str(size): row.count for size, row in sizes.items()}
                        for name, sizes in comms_logger.comms_dict.items()}
    print("RESULT " + json.dumps(result), flush=True)
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
