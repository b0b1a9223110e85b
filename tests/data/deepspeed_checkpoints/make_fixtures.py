"""Regenerates the DeepSpeed checkpoints under this folder with a real DeepSpeed.

Run from a side virtual environment holding DeepSpeed (not deepshard's)::

    DS_ACCELERATOR=cpu /path/to/dsvenv/bin/python tests/data/deepspeed_checkpoints/make_fixtures.py

For each case (ZeRO stage 0-3, fp32 and bf16, ...) it trains the tiny model of
``ds_fixture_model.py`` on 2 gloo ranks for 2 steps, saves a checkpoint (``client_state``
``{"epoch": 3}``), then continues 3 steps and records beside the checkpoint what DeepSpeed
reached (``expected.pt``: the fp32 weights at the save and after each continued step, the
losses, the learning rates). ``version.json`` records the DeepSpeed and torch versions.
"""

from __future__ import annotations

import json
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


def _config(stage: int, bf16: bool) -> dict:
    return fm.config(stage, bf16)


def _fp32_weights(engine, stage: int) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    opt = getattr(engine.optimizer, "fp32_groups", None) and engine.optimizer
    masters = {}  # bf16 at stage 0: DeepSpeed's unfused optimizer holds the fp32 masters
    if stage == 0 and opt is not None and hasattr(opt, "fp16_groups"):
        for low, high in zip(opt.fp16_groups, opt.fp32_groups, strict=True):
            masters.update((id(a), b) for a, b in zip(low, high, strict=True))
    out = {}
    for name, p in engine.module.named_parameters():
        value = masters.get(id(p))
        if value is None and stage > 0:
            value = safe_get_full_fp32_param(p)
        if value is None:
            value = p.detach()
        out[name] = value.detach().float().cpu().clone()
    return out


def _worker(rank: int, case: str, stage: int, bf16: bool, out: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    import deepspeed.comm.comm

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.comm.comm.cdb.shm_vector_kernel_level = 0
    torch.manual_seed(0)
    model = fm.Net()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=_config(stage, bf16))
    losses = []
    for step in range(fm.SAVE_AT):
        losses.append(fm.train_step(engine, step, rank, WORLD))
    ckpt = Path(out) / "ckpt"
    engine.save_checkpoint(str(ckpt), client_state={"epoch": 3})
    at_save = _fp32_weights(engine, stage)
    after, lrs = [], []
    for step in range(fm.SAVE_AT, fm.SAVE_AT + fm.CONTINUE):
        losses.append(fm.train_step(engine, step, rank, WORLD))
        after.append(_fp32_weights(engine, stage))
        lrs.append(engine.get_lr()[0])
    if rank == 0:
        torch.save({"at_save": at_save, "after": after, "losses": losses, "lrs": lrs,
                    "world_size": WORLD, "stage": stage, "bf16": bf16},
                   Path(out) / "expected.pt")
    deepspeed.comm.destroy_process_group()


CASES = {f"zero{s}_{p}": (s, p == "bf16") for s in range(4) for p in ("fp32", "bf16")}


def main() -> None:
    import deepspeed

    only = sys.argv[1:] or list(CASES)
    for i, case in enumerate(only):
        stage, bf16 = CASES[case]
        out = HERE / case
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        mp.spawn(_worker, args=(case, stage, bf16, str(out), 29600 + i), nprocs=WORLD)
        for script in out.glob("ckpt/*.py"):  # DeepSpeed's own converters: not fixtures
            script.unlink()
    (HERE / "version.json").write_text(json.dumps(
        {"deepspeed": deepspeed.__version__, "torch": torch.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
