"""Regenerates the DeepSpeed pipeline and MoE checkpoints under this folder with a real
DeepSpeed (the sibling of ``make_fixtures.py``, same recipe).

Run from a side virtual environment holding DeepSpeed (not deepshard's)::

    DS_ACCELERATOR=cpu /path/to/dsvenv/bin/python \
        tests/data/deepspeed_checkpoints/make_parallel_fixtures.py [case ...]

``pipe2_zero1`` / ``pipe2_zero0``: DeepSpeed's ``PipelineModule`` of
``ds_fixture_model.pipe_layers`` over 2 stages (2 gloo ranks: pipe 2, data 1), ZeRO-1 / no
ZeRO, fp32, 2 micro-batches per step. ``moe_ep2_zero2`` / ``moe_ep2_zero0``:
``ds_fixture_model.MoENet`` with DeepSpeed's ``MoE`` (4 experts, top-1, dropless) at
``ep_size`` 2 on 2 gloo ranks, ZeRO-2 / no ZeRO (which writes ``expp_rank_*`` optimizer
files), fp32. Each trains 2 steps, saves a checkpoint (``client_state`` ``{"epoch": 3}``),
continues 3 steps and records beside the checkpoint what DeepSpeed reached
(``expected.pt``: the whole model's fp32 weights at the save and after each continued
step, experts under their global ids; the losses; the learning rates).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ds_fixture_model as fm  # noqa: E402

WORLD = 2


def _start(rank: int, port: int):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    import deepspeed.comm.comm

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.comm.comm.cdb.shm_vector_kernel_level = 0
    return deepspeed


def _gathered(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's ``local`` weights merged (each rank holds another part)."""
    import torch.distributed as dist

    parts: list = [None] * WORLD
    dist.all_gather_object(parts, local)
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        out.update(part)
    return dict(sorted(out.items()))


def _fp32(engine, rename=lambda n: n) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    def full(p: torch.Tensor) -> torch.Tensor:  # without ZeRO (None): the parameter is fp32
        value = safe_get_full_fp32_param(p)
        return (p if value is None else value).detach().float().cpu().clone()

    return _gathered({rename(n): full(p) for n, p in engine.module.named_parameters()})


def _record(out: Path, rank: int, losses, at_save, after, lrs, **extra) -> None:
    if rank == 0:
        torch.save({"at_save": at_save, "after": after, "losses": losses, "lrs": lrs,
                    "world_size": WORLD, **extra}, out / "expected.pt")


def _pipe_worker(rank: int, out: str, port: int, stage: int) -> None:
    deepspeed = _start(rank, port)
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    model = PipelineModule(fm.pipe_layers(), num_stages=2,
                           loss_fn=torch.nn.functional.mse_loss,
                           partition_method="parameters")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=fm.pipe_config(stage))
    dp_rank, dp = engine.grid.data_parallel_id, engine.grid.data_parallel_size
    losses = [float(engine.train_batch(iter(fm.pipe_batches(s, dp_rank, dp))))
              for s in range(fm.SAVE_AT)]
    engine.save_checkpoint(str(Path(out) / "ckpt"), client_state={"epoch": 3})
    at_save, after, lrs = _fp32(engine), [], []
    for step in range(fm.SAVE_AT, fm.SAVE_AT + fm.CONTINUE):
        losses.append(float(engine.train_batch(iter(fm.pipe_batches(step, dp_rank, dp)))))
        after.append(_fp32(engine))
        lrs.append(engine.get_lr()[0])
    _record(Path(out), rank, losses, at_save, after, lrs, stage=stage, pipe=2,
            parts=list(model.parts))
    deepspeed.comm.destroy_process_group()


def _moe_worker(rank: int, out: str, port: int, stage: int) -> None:
    deepspeed = _start(rank, port)
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    ep = 2
    model = fm.moe_model(MoE, ep, rank % ep)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=fm.config(stage, False))
    ep_rank = groups._get_expert_parallel_rank(model.moe.expert_group_name)
    local = fm.EXPERTS // ep
    marker = ".deepspeed_experts."

    def rename(name: str) -> str:
        if marker not in name:
            return name
        head, tail = name.split(marker)
        i, rest = tail.split(".", 1)
        return f"{head}{marker}{ep_rank * local + int(i)}.{rest}"

    losses = [fm.moe_train_step(engine, s, rank, WORLD) for s in range(fm.SAVE_AT)]
    engine.save_checkpoint(str(Path(out) / "ckpt"), client_state={"epoch": 3})
    at_save, after, lrs = _fp32(engine, rename), [], []
    for step in range(fm.SAVE_AT, fm.SAVE_AT + fm.CONTINUE):
        losses.append(fm.moe_train_step(engine, step, rank, WORLD))
        after.append(_fp32(engine, rename))
        lrs.append(engine.get_lr()[0])
    _record(Path(out), rank, losses, at_save, after, lrs, stage=stage, ep_size=ep)
    deepspeed.comm.destroy_process_group()


CASES = {"pipe2_zero1": (_pipe_worker, 1), "pipe2_zero0": (_pipe_worker, 0),
         "moe_ep2_zero2": (_moe_worker, 2), "moe_ep2_zero0": (_moe_worker, 0)}


def main() -> None:
    for i, case in enumerate(sys.argv[1:] or CASES):
        out = HERE / case
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        worker, stage = CASES[case]
        mp.spawn(worker, args=(str(out), 29650 + i, stage), nprocs=WORLD)
        for script in out.glob("ckpt/*.py"):  # DeepSpeed's own converters: not fixtures
            script.unlink()


if __name__ == "__main__":
    main()
