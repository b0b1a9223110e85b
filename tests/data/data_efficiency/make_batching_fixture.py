"""Record DeepSpeed 0.19.8's dynamic batching (``variable_batch_size_and_lr``) as a JSON fixture.

Runs in a Python environment with DeepSpeed 0.19.8 (not deepshard's), on CPU::

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/data/data_efficiency/make_batching_fixture.py

Writes ``dynamic_batching_ds0198.json`` next to this script:

- ``batch``: ``batch_by_seqlens`` for each case of :data:`BATCH_CASES` (its arguments and
  its three results); ``departures``: the same for the cases where deepshard does otherwise
  on purpose (the test states how);
- ``lr``: the optimizer's learning rates after ``VariableBatchSizeLR``'s construction and
  each ``step()`` (a ``step(0)`` reset among them), for a constant learning rate, a
  ``LambdaLR`` and a ``StepLR``, with linear, sqrt and no scaling;
- ``loader``: the sample ids of each item of ``dataloader_for_variable_batch_size`` on each of
  two data-parallel ranks, plain and padded;
- ``entry``: what ``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed`` gives
  each of two ranks of a stand-in engine: loader items and the first learning rates.
"""

from __future__ import annotations

import json
import random
import types
import warnings
from pathlib import Path

import deepspeed
import torch
from deepspeed.runtime.data_pipeline.config import get_data_efficiency_config
from deepspeed.runtime.data_pipeline.data_sampling import variable_batch_size_and_lr as vbs

HERE = Path(__file__).resolve().parent
OUT = HERE / "dynamic_batching_ds0198.json"


def lengths(n: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


BATCH_CASES = {
    "dataloader": dict(seqlens=lengths(80, 1, 20, 0), max_tokens=40, effective_batch_size=4),
    "dataloader_min_max": dict(seqlens=lengths(80, 1, 20, 1), max_tokens=40, min_batch_size=2,
                               max_batch_size=4, effective_batch_size=4),
    "seqlen": dict(seqlens=lengths(100, 1, 30, 2), max_tokens=50, max_batch_size=8,
                   sequence_picking_order="seqlen", effective_batch_size=6),
    "random": dict(seqlens=lengths(90, 1, 25, 3), max_tokens=45, sequence_picking_order="random",
                   seed=42, effective_batch_size=4),
    "random_filtered": dict(seqlens=lengths(120, 1, 25, 4),
                            sequence_ids_per_mb=[i for i in range(120) if i % 3], max_tokens=40,
                            sequence_picking_order="random", seed=7, effective_batch_size=2),
    "same_size": dict(seqlens=lengths(100, 1, 20, 5), max_tokens=40, effective_batch_size=4,
                      required_microbatches_of_same_size=True),
    "same_size_seqlen_min": dict(seqlens=lengths(150, 1, 20, 6), max_tokens=60,
                                 effective_batch_size=8, min_batch_size=2,
                                 sequence_picking_order="seqlen",
                                 required_microbatches_of_same_size=True),
    "too_long": dict(seqlens=lengths(60, 1, 50, 7), max_tokens=40, effective_batch_size=2),
    "one_batch": dict(seqlens=lengths(12, 1, 10, 8), max_tokens=100, effective_batch_size=1),
}
# a sample that starts no valid micro-batch (min_batch_size 2, its neighbour too long):
# DeepSpeed ends the epoch there, deepshard skips it and goes on
DEPARTURES = {
    "stall": dict(seqlens=[5] * 16 + [30, 30] + [5] * 30, max_tokens=40, min_batch_size=2,
                  effective_batch_size=2),
    "stall_same_size": dict(seqlens=lengths(24, 1, 8, 9) + [38] * 3 + lengths(40, 1, 8, 10),
                            max_tokens=40, min_batch_size=2, effective_batch_size=2,
                            required_microbatches_of_same_size=True),
}

BATCH_SIZES = [5, 3, 8, 2, 6, 4, 7, 5, 3, 9]
SCHEDULERS = {
    "constant": {"kind": "constant"},
    "lambda": {"kind": "lambda", "decay": 0.9},
    "step": {"kind": "step", "step_size": 3, "gamma": 0.5},
}
# the calls after construction: None is step(), an integer step(n)
STEPS = [None] * 12 + [0] + [None] * 3


def make_scheduler(spec: dict, optimizer: torch.optim.Optimizer):
    if spec["kind"] == "constant":
        return optimizer
    if spec["kind"] == "lambda":
        decay = spec["decay"]
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: decay ** (e + 1))
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=spec["step_size"],
                                           gamma=spec["gamma"])


def make_optimizer() -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    return torch.optim.SGD([{"params": [params[0]], "lr": 0.1},
                            {"params": [params[1]], "lr": 0.02}])


def record_batches(cases: dict) -> dict:
    out = {}
    for name, args in cases.items():
        ids, sizes, max_seqlens = vbs.batch_by_seqlens(**args)
        out[name] = {"args": args, "microbatch_ids": [[b, list(map(int, m))] for b, m in ids],
                     "batch_sizes": [int(s) for s in sizes],
                     "batch_max_seqlens": [int(s) for s in max_seqlens]}
    return out


def record_lrs() -> dict:
    out = {}
    for sched_name, spec in SCHEDULERS.items():
        for method in ("linear", "sqrt", "none"):
            optimizer = make_optimizer()
            scheduler = vbs.lr_scheduler_for_variable_batch_size(
                base_batch_size=4, batch_sizes=BATCH_SIZES, dataloader=None,
                lr_scheduler_or_optimizer=make_scheduler(spec, optimizer),
                lr_scaling_method=method)
            lrs = [[g["lr"] for g in optimizer.param_groups]]
            for epoch in STEPS:
                optimizer.step()
                scheduler.step(epoch)
                lrs.append([g["lr"] for g in optimizer.param_groups])
            out[f"{sched_name}_{method}"] = {"scheduler": spec, "method": method,
                                             "base_batch_size": 4, "batch_sizes": BATCH_SIZES,
                                             "steps": STEPS, "lrs": lrs}
    return out


def record_loader() -> dict:
    args = BATCH_CASES["dataloader"] | {"effective_batch_size": 8}
    ids, _, max_seqlens = vbs.batch_by_seqlens(**args)
    out = {"args": args, "num_replicas": 2, "batch_size": 2, "plain": [], "padded": []}
    for rank in range(2):
        loader, _ = vbs.dataloader_for_variable_batch_size(
            list(range(len(args["seqlens"]))), ids, max_seqlens, dataloader_rank=rank,
            dataloader_batch_size=2, dataloader_num_replicas=2, dataloader_num_workers=0)
        out["plain"].append([list(map(int, item)) for item in loader])
        loader, _ = vbs.dataloader_for_variable_batch_size(
            [(i,) for i in range(len(args["seqlens"]))], ids, max_seqlens, dataloader_rank=rank,
            dataloader_batch_size=2, dataloader_num_replicas=2, dataloader_num_workers=0,
            required_microbatches_of_same_seqlen=True,
            sample_padding_fn=lambda sample, size: [sample[0], size])
        out["padded"].append([[list(map(int, s)) for s in item] for item in loader])
    return out


def record_entry() -> dict:
    section = {"enabled": True, "seed": 42,
               "data_sampling": {"enabled": True, "num_workers": 0, "dynamic_batching": {
                   "enabled": True, "max_tokens": 40, "lr_scaling_method": "sqrt",
                   "min_batch_size": 1, "max_batch_size": 6,
                   "sequence_picking_order": "random"}}}
    seqlens = lengths(200, 2, 18, 10)
    out = {"data_efficiency": section, "seqlens": seqlens, "train_batch_size": 8,
           "micro_batch_size": 2, "dp_world_size": 2, "ranks": []}
    for rank in range(2):
        optimizer = make_optimizer()
        engine = types.SimpleNamespace(
            _config=types.SimpleNamespace(
                data_efficiency_config=get_data_efficiency_config({"data_efficiency": section})),
            train_batch_size=lambda: 8, train_micro_batch_size_per_gpu=lambda: 2,
            data_parallel_group=types.SimpleNamespace(rank=lambda r=rank: r, size=lambda: 2),
            lr_scheduler=None, optimizer=optimizer)
        build = vbs.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed
        loader, scheduler, kwargs = build(dataset=list(range(len(seqlens))), engine=engine,
                                          dataset_seqlens=seqlens)
        lrs = [[g["lr"] for g in optimizer.param_groups]]
        for _ in range(6):
            optimizer.step()
            scheduler.step()
            lrs.append([g["lr"] for g in optimizer.param_groups])
        out["ranks"].append({"items": [list(map(int, item)) for item in loader], "lrs": lrs,
                             "batch_sizes": [int(s) for s in scheduler.batch_sizes],
                             "io_kwargs": sorted(kwargs)})
    return out


def main() -> None:
    warnings.simplefilter("ignore")
    fixture = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
               "batch": record_batches(BATCH_CASES), "departures": record_batches(DEPARTURES),
               "lr": record_lrs(), "loader": record_loader(), "entry": record_entry()}
    OUT.write_text(json.dumps(fixture, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
