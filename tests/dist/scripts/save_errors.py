"""Checkpoint and usage errors as a worker meets them; ``RESULT <json>`` on rank 0.

Modes (argv[1], the checkpoint directory argv[2]):
- ``save <dir> <tag> <mib>``: train one step of a tiny model, then save ``tag`` with
  ``client_state`` holding ``mib`` MiB (rank 0's shared file only); uncaught errors are
  left to the worker's exception hook;
- ``caught <dir>``: save with a bad tag inside ``try``/``except UsageError`` and report
  the error's text, then train on (the process must not have exited);
- ``twice-in-backward <dir>``: ``engine.backward`` of two reentrant checkpoints of the
  same module, so each parameter gets its gradient twice in one backward (the error is
  raised inside an autograd hook), uncaught;
- ``per-rank-dir <dir>``: every rank saves into ``<dir>/rank<N>`` (a name made from each
  rank's own state), uncaught.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.utils.checkpoint

import deepshard
from deepshard.errors import UsageError

CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def step(engine) -> None:
    torch.manual_seed(dist.get_rank())
    loss = engine(torch.randn(2, 16)).pow(2).mean()
    engine.backward(loss)
    engine.step()


def main(mode: str, directory: str, *rest: str) -> None:
    torch.manual_seed(0)
    engine, _, _, _ = deepshard.initialize(model=torch.nn.Linear(16, 16), config=CONFIG)
    step(engine)
    result = {}
    if mode == "save":
        tag, mib = rest[0], int(rest[1])
        engine.save_checkpoint(directory, tag=tag,
                               client_state={"blob": torch.zeros(mib << 18)})
    elif mode == "caught":
        try:
            engine.save_checkpoint(directory, tag="latest")
        except UsageError as exc:
            result["caught"] = str(exc)
        step(engine)
        result["steps"] = engine.global_steps
    elif mode == "per-rank-dir":
        engine.save_checkpoint(f"{directory}/rank{dist.get_rank()}")
    elif mode == "twice-in-backward":
        x = torch.randn(2, 16, requires_grad=True)
        twice = [torch.utils.checkpoint.checkpoint(engine.module, x, use_reentrant=True)
                 for _ in range(2)]
        engine.backward(twice[0].sum() + twice[1].sum())
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*(a for a in sys.argv[1:] if not a.startswith("--local_rank")))
