"""One rank of the elastic benchmark (``benchmarks/elastic.py``): a tiny model that
checkpoints every step, under ds-run (deepshard) or torchrun (plain torch DDP).

    elastic_worker.py WORKDIR --runtime deepshard --deepspeed_config PATH [--delay S]
    elastic_worker.py WORKDIR --runtime torch --train-batch N [--delay S]

Both train a ``Linear(4, 1)`` with Adam on a fixed synthetic dataset at a constant global
batch (``train_batch_size``, micro batch 1: the accumulation steps follow the world size).

* ``deepshard``: ``deepshard.initialize`` (ZeRO stage 1) with the loader it builds, a
  ``save_checkpoint`` after every step and, at start, ``load_checkpoint`` of the latest
  complete one (deepshard reshards it to the current world size; the data position is in it).
* ``torch``: what a torchrun script has to do itself: ``DistributedDataParallel`` over gloo,
  the global batch split by hand into ``train_batch / world`` micro-batches per rank (under
  ``no_sync`` but the last), rank 0 ``torch.save``-ing model, optimizer and step to a
  temporary file renamed over ``WORKDIR/torch.pt`` after every step, and every rank loading
  it at start.

Rank 0 prints ``BOOT`` first, before it imports torch (the launcher's part of a relaunch
ends there), ``RESUMED step S load_s X`` after a load (X: the seconds the load took) and
``STEP <n> world <w>`` after each step's checkpoint; after the first step of each start,
``STARTCPU <s>``: the CPU seconds every rank's process has used since it started (summed
over the ranks: on hosts that share this machine's cores, a floor under the start's time).
The job ends, on every rank at the same step, once ``WORKDIR/stop`` exists (an all-reduce
of the flag every step).
"""

from __future__ import annotations

import os

if os.environ.get("RANK") == "0":
    print("BOOT", flush=True)

import argparse
import contextlib
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

SAMPLES = 1 << 15


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(SAMPLES, 1,
                                                                            generator=g)
    return torch.utils.data.TensorDataset(x, y)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def say_start_cpu() -> None:
    """``STARTCPU``: this start's CPU seconds so far, summed over the ranks."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = torch.tensor([usage.ru_utime + usage.ru_stime], dtype=torch.float64)
    dist.all_reduce(total)
    say(f"STARTCPU {float(total):.2f}")


def stop_now(workdir: Path) -> bool:
    """Whether any rank sees the stop file (every rank gets the same answer)."""
    flag = torch.tensor([1.0 if (workdir / "stop").exists() else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def run_deepshard(args: argparse.Namespace) -> None:
    import deepshard

    ckpt = str(args.workdir / "ckpt")
    net = model()
    engine, _, loader, _ = deepshard.initialize(
        model=net, model_parameters=net.parameters(), training_data=dataset(),
        config=args.deepspeed_config)
    start = time.perf_counter()
    path, _ = engine.load_checkpoint(ckpt)
    if path is not None:
        say(f"RESUMED step {engine.global_steps} load_s {time.perf_counter() - start:.4f}")
    world, batches, fresh = engine.world_size, iter(loader), True
    while not stop_now(args.workdir):
        before = engine.global_steps
        while engine.global_steps == before:
            x, y = next(batches)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
        engine.save_checkpoint(ckpt)
        say(f"STEP {engine.global_steps} world {world}")
        if fresh:
            fresh = False
            say_start_cpu()
        time.sleep(args.delay)


def run_torch(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.train_batch % world:
        raise SystemExit(f"train batch {args.train_batch} does not split over {world} ranks")
    net, data = model(), dataset()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    ckpt, step = args.workdir / "torch.pt", 0
    if ckpt.exists():
        start = time.perf_counter()
        state = torch.load(ckpt)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        say(f"RESUMED step {step} load_s {time.perf_counter() - start:.4f}")
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0))
    micro, fresh = args.train_batch // world, True
    while not stop_now(args.workdir):
        first = step * args.train_batch % SAMPLES
        mine = order[first:first + args.train_batch][rank::world]
        opt.zero_grad()
        for i, idx in enumerate(mine.tolist()):
            x, y = data[[idx]]
            sync = i == micro - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = torch.nn.functional.mse_loss(ddp(x), y) / micro
                loss.backward()
        opt.step()
        step += 1
        if rank == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                        "step": step}, tmp)
            os.replace(tmp, ckpt)
        say(f"STEP {step} world {world}")
        if fresh:
            fresh = False
            say_start_cpu()
        time.sleep(args.delay)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--runtime", choices=("deepshard", "torch"), required=True)
    parser.add_argument("--deepspeed_config")
    parser.add_argument("--train-batch", type=int, default=6)
    parser.add_argument("--delay", type=float, default=0.1)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_known_args()[0]
    torch.set_num_threads(1)
    if args.runtime == "deepshard":
        run_deepshard(args)
    else:
        run_torch(args)


if __name__ == "__main__":
    main()
