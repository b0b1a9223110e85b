"""Run by DeepSpeed (the side venv): DeepSpeed resumes a universal checkpoint on one
rank at a ZeRO stage and trains the 3 global batches after the save; writes the fp32
weights after each step (``torch.save``) for the test of the way back to DeepSpeed.

    DS_ACCELERATOR=cpu python ds_resume_universal.py LOAD_DIR STAGE OUT_FILE

The model is built from seed 0, the saving job's: DeepSpeed 0.19.8's universal load
leaves frozen parameters at their initial values (see ``make_fixtures.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ds_fixture_model as fm  # noqa: E402
from make_fixtures import _fp32_weights  # noqa: E402


def main() -> None:
    load_dir, stage, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29650"))
    import deepspeed
    import deepspeed.comm.comm

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.comm.comm.cdb.shm_vector_kernel_level = 0
    torch.manual_seed(0)
    model = fm.Net()
    cfg = {**fm.config(stage, False), "checkpoint": {"load_universal": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=cfg)
    engine.load_checkpoint(load_dir)
    after, lrs = [], []
    for step in range(fm.SAVE_AT, fm.SAVE_AT + fm.CONTINUE):
        fm.train_step(engine, step, 0, 1)
        after.append(_fp32_weights(engine, stage))
        lrs.append(engine.get_lr()[0])
    torch.save({"at_save": None, "after": after, "lrs": lrs,
                "global_steps": engine.global_steps}, out)
    deepspeed.comm.destroy_process_group()
    # DeepSpeed's CPU build now and then aborts in its teardown ("terminate called without
    # an active exception") after everything is written: leave without it
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
