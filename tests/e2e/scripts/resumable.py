"""A job that checkpoints every step and resumes from its last complete checkpoint.

    resumable.py WORKDIR --steps N [--delay S] [--hang-rank R --hang-step K]

Each step all-reduces ``step * (rank + 1)`` and adds it to an accumulator; every rank
saves its state for that step, then (after a barrier) rank 0 records the step as the
latest complete checkpoint, atomically. A restarted job (DEEPSHARD_RESTART_COUNT > 0)
resumes there, so the final accumulator is the same as an uninterrupted run's:
N(N+1)/2 * W(W+1)/2. ``--hang-rank`` stops heartbeating (on the first attempt only)
inside ``stuck_in_here`` at ``--hang-step``.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("workdir")
parser.add_argument("--local_rank", type=int)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--delay", type=float, default=0.2)
parser.add_argument("--hang-rank", type=int, default=-1)
parser.add_argument("--hang-step", type=int, default=-1)
args, _ = parser.parse_known_args()
work = Path(args.workdir)
rank = int(os.environ["RANK"])
restart = int(os.environ.get("DEEPSHARD_RESTART_COUNT", "0"))
# first thing, before torch: when this attempt's workers came up (the restart latency)
(work / f"up_{restart}_{rank}").write_text(f"{os.getpid()} {time.time()}")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import deepshard  # noqa: E402


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def stuck_in_here() -> None:
    while True:
        time.sleep(1)


env = deepshard.init_distributed()
latest = work / "latest"
start = int(latest.read_text()) if latest.exists() else 0
acc = json.loads((work / f"ckpt_{rank}_{start}.json").read_text())["acc"] if start else 0.0
print(f"attempt {restart} resumes after step {start}", flush=True)
for step in range(start + 1, args.steps + 1):
    if rank == args.hang_rank and step == args.hang_step and restart == 0:
        stuck_in_here()
    value = torch.tensor([float(step * (rank + 1))])
    dist.all_reduce(value)
    acc += value.item()
    atomic_write(work / f"ckpt_{rank}_{step}.json", json.dumps({"acc": acc}))
    dist.barrier()
    if rank == 0:
        atomic_write(latest, str(step))
    deepshard.heartbeat(step)
    print(f"step {step} acc {acc}", flush=True)
    time.sleep(args.delay)
if rank == 0:
    print(f"RESULT {acc} after {restart} restart(s)", flush=True)
dist.destroy_process_group()
sys.exit(0)
