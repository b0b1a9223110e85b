"""Run ``hf_trainer_train.py`` through deepshard and through transformers + DeepSpeed on 2
CPU ranks and print the largest per-step differences (not a test: DeepSpeed is never a
deepshard dependency).

    .venv/bin/python tests/integrations/scripts/hf_trainer_compare.py \\
        --ds_venv /tmp/dsvenv --out_dir /tmp/hf_compare

``--ds_venv`` is a virtualenv with deepspeed, transformers and accelerate (it runs with
``DS_ACCELERATOR=cpu`` under its ``torchrun``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
TRAIN = HERE / "hf_trainer_train.py"
COMMON = ["--gas", "2", "--steps", "6", "--warmup", "2", "--evaluate"]
CASES = {
    "zero2": "--stage 2",
    "zero3": "--stage 3",
    "zero2-config-optim": "--stage 2 --config_optim",
    "zero3-config-optim": "--stage 3 --config_optim",
    "zero2-bf16": "--stage 2 --bf16",
    "zero3-bf16": "--stage 3 --bf16",
    "zero2-lora": "--stage 2 --lora",
    "zero3-lora": "--stage 3 --lora",
}


def run(argv: list[str], env: dict[str, str]) -> None:
    result = subprocess.run(argv, cwd=ROOT, env=env, text=True, capture_output=True)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(argv)}\n{result.stdout[-3000:]}{result.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ds_venv", default="/tmp/dsvenv")
    p.add_argument("--out_dir", default="/tmp/hf_compare")
    args = p.parse_args()
    out = Path(args.out_dir)
    cases = [a for name, flags in CASES.items() for a in ("--case", f"{name} {flags}")]
    ds_run = Path(sys.executable).with_name("ds-run")
    run([str(ds_run), "--num_gpus", "2", str(TRAIN), *COMMON, "--out_dir",
         str(out / "deepshard"), *cases], dict(os.environ))
    torchrun = Path(args.ds_venv) / "bin" / "torchrun"
    run([str(torchrun), "--nproc_per_node", "2", str(TRAIN), "--backend", "deepspeed",
         *COMMON, "--out_dir", str(out / "deepspeed"), *cases],
        {**os.environ, "DS_ACCELERATOR": "cpu"})
    for name in CASES:
        ours = json.loads((out / "deepshard" / name / "rank0.json").read_text())
        theirs = json.loads((out / "deepspeed" / name / "rank0.json").read_text())
        diffs = {key: max(abs(a - b) for a, b in zip(ours[key], theirs[key], strict=True))
                 for key in ("losses", "grad_norms", "lrs")}
        print(f"{name}: losses {ours['losses']}")
        print(f"  max |deepshard - deepspeed|: loss {diffs['losses']:.3g}, grad_norm "
              f"{diffs['grad_norms']:.3g}, lr {diffs['lrs']:.3g}, eval_loss "
              f"{abs(ours['eval_loss'] - theirs['eval_loss']):.3g}")


if __name__ == "__main__":
    main()
