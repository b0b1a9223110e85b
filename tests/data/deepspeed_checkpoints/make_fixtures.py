"""Regenerates the DeepSpeed checkpoints under this folder with a real DeepSpeed.

Run from a side virtual environment holding DeepSpeed (not deepshard's)::

    DS_ACCELERATOR=cpu /path/to/dsvenv/bin/python tests/data/deepspeed_checkpoints/make_fixtures.py

For each case (ZeRO stage 0-3, fp32 and bf16) it trains the tiny model of
``ds_fixture_model.py`` on 2 gloo ranks for 2 steps, saves a checkpoint (``client_state``
``{"epoch": 3}``), then continues 3 steps and records beside the checkpoint what DeepSpeed
reached (``expected.pt``: the fp32 weights at the save and after each continued step, the
losses, the learning rates). ``universal_zero2`` is ``zero2_fp32`` converted by DeepSpeed's
``ds_to_universal`` and resumed by DeepSpeed on one rank (``deepspeed_universal_resume.pt``;
its right continuation is ``zero2_fp32/expected.pt``). ``hf_trainer_zero2`` is an HF
Trainer ``checkpoint-2/`` folder written with DeepSpeed. ``version.json`` records the
DeepSpeed and torch versions. The pipeline and MoE cases come from the sibling
``make_parallel_fixtures.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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


def _universal_worker(rank: int, out: str, port: int) -> None:
    """DeepSpeed's own resume of the universal folder on one rank (ZeRO-2): 3 steps, from
    a model initialised from another seed than the saving job's. DeepSpeed 0.19.8 leaves
    the frozen layer at that initial value (its universal load skips frozen parameters),
    so this record differs from ``zero2_fp32/expected.pt``: kept to show it."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed
    import deepspeed.comm.comm

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.comm.comm.cdb.shm_vector_kernel_level = 0
    torch.manual_seed(1)
    model = fm.Net()
    cfg = {**fm.config(2, False), "checkpoint": {"load_universal": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=cfg)
    engine.load_checkpoint(str(Path(out) / "ckpt"))
    at_save = _fp32_weights(engine, 2)
    after, lrs, losses = [], [], []
    for step in range(fm.SAVE_AT, fm.SAVE_AT + fm.CONTINUE):
        losses.append(fm.train_step(engine, step, 0, 1))
        after.append(_fp32_weights(engine, 2))
        lrs.append(engine.get_lr()[0])
    torch.save({"at_save": at_save, "after": after, "losses": losses, "lrs": lrs,
                "world_size": 1, "stage": 2, "bf16": False},
               Path(out) / "deepspeed_universal_resume.pt")
    deepspeed.comm.destroy_process_group()


def _universal(port: int) -> None:
    """``universal_zero2``: zero2_fp32's checkpoint through DeepSpeed's ds_to_universal
    (which needs --inject_missing_state at ZeRO-2), resumed by DeepSpeed on 1 rank."""
    out = HERE / "universal_zero2"
    shutil.rmtree(out, ignore_errors=True)
    (out / "ckpt").mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", str(HERE / "zero2_fp32" / "ckpt" / "global_step2"),
                    "--output_folder", str(out / "ckpt" / "global_step2_universal"),
                    "--inject_missing_state", "--num_extract_workers", "1",
                    "--num_merge_workers", "1"], check=True, stdout=subprocess.DEVNULL)
    mp.spawn(_universal_worker, args=(str(out), port), nprocs=1)


def _hf_trainer() -> None:
    """``hf_trainer_zero2``: the HF Trainer with DeepSpeed (ZeRO-2, 2 ranks, the tiny
    Llama of ``tests/integrations``) trains 4 steps saving every 2; kept: ``checkpoint-2``
    (without DeepSpeed's converter scripts) and the losses DeepSpeed logged
    (``deepspeed.json``)."""
    import tempfile

    out = HERE / "hf_trainer_zero2"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    root = HERE.parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                        "2", str(root / "tests" / "integrations" / "scripts" /
                                 "hf_trainer_train.py"),
                        "--backend", "deepspeed", "--stage", "2", "--steps", "4",
                        "--save_steps", "2", "--out_dir", tmp], check=True, cwd=root,
                       stdout=subprocess.DEVNULL)
        shutil.copytree(Path(tmp) / "run" / "checkpoint-2", out / "checkpoint-2",
                        ignore=shutil.ignore_patterns("zero_to_*.py"))
        shutil.copy(Path(tmp) / "rank0.json", out / "deepspeed.json")


CASES = {f"zero{s}_{p}": (s, p == "bf16") for s in range(4) for p in ("fp32", "bf16")}


def main() -> None:
    import deepspeed

    only = sys.argv[1:] or [*CASES, "universal_zero2", "hf_trainer_zero2"]
    for i, case in enumerate(only):
        if case == "hf_trainer_zero2":
            _hf_trainer()
            continue
        if case == "universal_zero2":
            _universal(29700)
            continue
        stage, bf16 = CASES[case]
        out = HERE / case
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        mp.spawn(_worker, args=(case, stage, bf16, str(out), 29600 + i), nprocs=WORLD)
        for script in out.glob("ckpt/*.py"):  # DeepSpeed's own converters: not fixtures
            script.unlink()
    import transformers

    (HERE / "version.json").write_text(json.dumps(
        {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
         "transformers": transformers.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
