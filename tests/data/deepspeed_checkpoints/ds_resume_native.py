"""Run by DeepSpeed (the side venv): DeepSpeed resumes a checkpoint deepshard wrote in
DeepSpeed's own layout (``checkpoint.format: "deepspeed"``) on 2 gloo ranks at the stage
that wrote it, and trains the 3 global batches after the save; rank 0 writes the fp32
weights after each step (``torch.save``) for the test of the way back to DeepSpeed.

    DS_ACCELERATOR=cpu python ds_resume_native.py LOAD_DIR STAGE BF16(0|1) OUT_FILE
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ds_fixture_model as fm  # noqa: E402
from make_fixtures import _fp32_weights  # noqa: E402

WORLD = 2


def _worker(rank: int, load_dir: str, stage: int, bf16: bool, out: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    import deepspeed.comm.comm

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.comm.comm.cdb.shm_vector_kernel_level = 0
    torch.manual_seed(1)  # not the saving job's seed: the load must set every value
    model = fm.Net()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=fm.config(stage, bf16))
    _, client = engine.load_checkpoint(load_dir)
    at_save = _fp32_weights(engine, stage)
    after, lrs = [], []
    for step in range(fm.SAVE_AT, fm.SAVE_AT + fm.CONTINUE):
        fm.train_step(engine, step, rank, WORLD)
        after.append(_fp32_weights(engine, stage))
        lrs.append(engine.get_lr()[0])
    if rank == 0:
        torch.save({"at_save": at_save, "after": after, "lrs": lrs,
                    "global_steps": engine.global_steps, "client": client}, out)
    deepspeed.comm.destroy_process_group()
    # DeepSpeed's CPU build now and then aborts in its teardown ("terminate called without
    # an active exception") after everything is written: leave without it
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    load_dir, stage, bf16, out = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
    port = int(os.environ.get("MASTER_PORT", "29660"))
    mp.spawn(_worker, args=(load_dir, stage, bf16, out, port), nprocs=WORLD)


if __name__ == "__main__":
    main()
