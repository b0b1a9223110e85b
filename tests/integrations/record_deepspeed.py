"""Record what DeepSpeed 0.19.8 gives on the HF-native scripts, for
``test_hf_native.py`` to compare deepshard's compat path with (the fixture
``tests/data/hf_native_deepspeed.json``; committed, so the tests need no DeepSpeed).

    python tests/integrations/record_deepspeed.py [--python /tmp/dsvenv/bin/python]

Each case runs the same script the test runs under ``ds-run --deepspeed_compat``, with
``torchrun --nproc_per_node 2`` of the side venv and ``DS_ACCELERATOR=cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "integrations" / "scripts"
OUT = ROOT / "tests" / "data" / "hf_native_deepspeed.json"

# the same training as test_hf_trainer.TRAINING / test_hf_native.TRAINER_ARGS
TRAINER = ("--backend", "deepspeed", "--micro", "2", "--gas", "2", "--steps", "6", "--lr",
           "1e-2", "--warmup", "2", "--clip", "0.5")
CASES: dict[str, tuple[str, ...]] = {
    "trainer-s2": ("hf_trainer_train.py", *TRAINER, "--stage", "2"),
    "trainer-s3": ("hf_trainer_train.py", *TRAINER, "--stage", "3"),
    "accelerate-s2": ("accelerate_train.py", "--stage", "2"),
    "accelerate-s3": ("accelerate_train.py", "--stage", "3"),
    "sft-s2": ("trl_train.py", "--trainer", "sft", "--stage", "2"),
    "sft-s3": ("trl_train.py", "--trainer", "sft", "--stage", "3"),
    "dpo-s3": ("trl_train.py", "--trainer", "dpo", "--stage", "3"),
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--python", default="/tmp/dsvenv/bin/python")
    args = p.parse_args()
    version = subprocess.run([args.python, "-c", "import deepspeed; print(deepspeed.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    found: dict[str, object] = {"deepspeed": version}
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    for name, (script, *rest) in CASES.items():
        with tempfile.TemporaryDirectory() as out:
            cmd = [args.python, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   str(SCRIPTS / script), *rest, "--out_dir", out]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                print(f"{name}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                return 1
            result = json.loads((Path(out) / "rank0.json").read_text())
            found[name] = {k: result[k] for k in ("losses", "grad_norms")}
            print(name, found[name])
    OUT.write_text(json.dumps(found, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
