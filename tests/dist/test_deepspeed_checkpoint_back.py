"""The way back to DeepSpeed: deepshard trains the fixture model (2 ranks, ZeRO 0-3),
saves, converts its checkpoint with its ``ds_to_universal``, and DeepSpeed 0.19.8 (the
side venv; skipped when absent) resumes that universal folder on one rank with
``checkpoint.load_universal`` (at ZeRO-1 for deepshard's stage 0) and trains 3 more
steps: its weights equal deepshard's own continuation (1e-6), and its step count goes on
from the save. And the direct way: deepshard saves in DeepSpeed's own layout
(``checkpoint.format: "deepspeed"``, ZeRO 0-3, fp32 and bf16) and DeepSpeed resumes it
on 2 ranks at the same stage with a plain ``load_checkpoint``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, run_ds

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "ds_checkpoint_resume.py")
DS_SCRIPT = ROOT / "tests" / "data" / "deepspeed_checkpoints" / "ds_resume_universal.py"
DS_PYTHON = Path(os.environ.get("DEEPSHARD_DEEPSPEED_PYTHON", "/tmp/dsvenv/bin/python"))


def _has_deepspeed() -> bool:
    if not DS_PYTHON.exists():
        return False
    return subprocess.run([str(DS_PYTHON), "-c", "import deepspeed"], capture_output=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}).returncode == 0


pytestmark = pytest.mark.skipif(not _has_deepspeed(),
                                reason=f"no DeepSpeed side venv at {DS_PYTHON}")


# (deepshard's stage, DeepSpeed's): DeepSpeed's universal load needs ZeRO 1-3
@pytest.mark.parametrize(("stage", "ds_stage"), [(0, 1), (1, 1), (2, 2), (3, 3)])
def test_deepspeed_resumes_deepshards_checkpoint(stage, ds_stage, tmp_path):
    done = run_ds("--num_gpus", "2", SCRIPT, "train", str(tmp_path), str(stage), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", MASTER_PORT=str(29650 + stage))
    out = tmp_path / "deepspeed.pt"
    ds = subprocess.run([str(DS_PYTHON), str(DS_SCRIPT), str(tmp_path / "universal"),
                         str(ds_stage), str(out)], env=env, capture_output=True, text=True,
                        timeout=300, cwd=ROOT)
    assert ds.returncode == 0, ds.stderr[-3000:]
    theirs = torch.load(out, weights_only=False)
    ours = torch.load(tmp_path / "expected.pt", weights_only=False)
    assert theirs["global_steps"] == 5
    assert theirs["lrs"] == pytest.approx(ours["lrs"], rel=1e-12)
    for got, want in zip(theirs["after"], ours["after"], strict=True):
        assert sorted(got) == sorted(want)
        assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-6


NATIVE_SCRIPT = ROOT / "tests" / "data" / "deepspeed_checkpoints" / "ds_resume_native.py"


@pytest.mark.parametrize(("stage", "bf16"), [(0, False), (1, False), (2, False), (3, False),
                                             (2, True), (3, True)])
def test_deepspeed_resumes_deepshards_own_layout(stage, bf16, tmp_path):
    """``checkpoint.format: "deepspeed"``: DeepSpeed 0.19.8 loads what deepshard wrote
    as it loads its own checkpoint (2 ranks, the same stage) and continues exactly as
    deepshard does (bf16 too: both keep the fp32 buffer and round alike)."""
    flags = ["deepspeed", *(["bf16"] if bf16 else [])]
    done = run_ds("--num_gpus", "2", SCRIPT, "train", str(tmp_path), str(stage), *flags,
                  timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", MASTER_PORT=str(29670 + 2 * stage + bf16))
    out = tmp_path / "deepspeed.pt"
    ds = subprocess.run([str(DS_PYTHON), str(NATIVE_SCRIPT), str(tmp_path / "ckpt"),
                         str(stage), "1" if bf16 else "0", str(out)], env=env,
                        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert ds.returncode == 0, ds.stderr[-3000:]
    theirs = torch.load(out, weights_only=False)
    ours = torch.load(tmp_path / "expected.pt", weights_only=False)
    assert theirs["global_steps"] == 5 and theirs["client"]["epoch"] == 3
    assert theirs["lrs"] == pytest.approx(ours["lrs"], rel=1e-12)
    for got, want in zip([theirs["at_save"], *theirs["after"]],
                         [ours["at_save"], *ours["after"]], strict=True):
        assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-6
