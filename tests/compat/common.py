"""What the compat tests share: run a script under ``ds-run --deepspeed_compat``, read what
its ranks saved, and measure how far a run is from its reference."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.helpers import ROOT, run_ds

SCRIPTS = ROOT / "tests" / "compat" / "scripts"
TOL = 1e-5  # fp32: only reduction order differs between 2 ranks and one process
DEFAULT_CLIP = 1.0  # gradient_clipping when a config leaves it out (DeepSpeed 0.19, deepshard)


def run_compat(script: str, out_dir: Path, *args: str, world: int = 2,
               threads: int | None = None, output: list | None = None) -> list[dict]:
    """Run ``scripts/<script>`` unchanged on ``world`` gloo CPU ranks with ``import
    deepspeed`` resolving to deepshard; returns what each rank saved in ``out_dir``.
    ``threads``: each worker's OMP_NUM_THREADS (default: ds-run's, cores / workers);
    ``output``: a list the job's stdout is appended to."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    result = run_ds("--num_gpus", str(world), "--deepspeed_compat", str(SCRIPTS / script),
                    *args, "--out_dir", str(out_dir), env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    if output is not None:
        output.append(result.stdout)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest absolute difference between two state dicts with the same keys, and
    where it is."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    worst = max(want, key=lambda k: (got[k].float() - want[k].float()).abs().max().item())
    return (got[worst].float() - want[worst].float()).abs().max().item(), worst


def loss_diff(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want), (got, want)
    return max(abs(a - b) for a, b in zip(got, want, strict=True))
