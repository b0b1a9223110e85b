"""Data efficiency on a real corpus: time to the baseline's validation loss, with curriculum
learning (sequence length), random-LTD and both.

Each row is one ``benchmarks/data_efficiency_worker.py`` process (one rank, gloo, 2
threads), one after another on a quiet machine: the small GPT (``examples/gpt.py``: bytes,
width 256, 6 blocks, 8 heads, sequence 256, micro-batch 16, AdamW lr 2e-3 with 20 warm-up
steps) on the standard library's source, validated on a held-out 10% of it. First the
baseline trains ``--steps`` steps; its final validation loss is the target. Then each
variant trains the same ``--steps`` (its schedules sized to them), going on up to
``--max_factor`` x the steps until it has reached the target and trained as long as the
baseline:

* time to target: training wall seconds (evaluations not counted) until the validation loss
  is at or below the target, linearly interpolated between evaluations; the speed-up is
  the baseline's time over it;
* tokens to target: tokens fed to the model by then (after the curriculum's truncation;
  random-LTD's dropped tokens still count: they enter the model);
* loss at the same steps and at the same wall time as the baseline: "no worse final loss
  for the same budget".

Target (printed with the table): both switches reach the baseline's loss in at most 1/1.3
of its wall time, and their loss at the baseline's budget is no worse.

    make bench-data-efficiency            # = python benchmarks/data_efficiency.py
    python benchmarks/data_efficiency.py [--steps 400] [--variants baseline,curriculum,ltd,both]
                                         [--eval_every 20] [--results DIR]

The record goes to ``benchmarks/results/data_efficiency.json`` (``benchmarks/record.py``);
``python benchmarks/plot.py --only data_efficiency`` draws
``docs/plots/data_efficiency.png`` (validation loss against wall time) from it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "data_efficiency_worker.py"
sys.path.insert(0, str(HERE))

from record import Run, loadavg  # noqa: E402

VARIANTS = ("baseline", "curriculum", "ltd", "both")
SPEEDUP_TARGET = 1.3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval_every", type=int, default=20)
    parser.add_argument("--max_factor", type=float, default=1.5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--worker_args", default="",
                        help="extra arguments for every worker (model size, schedules)")
    args = parser.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or args.variants[:1] != ["baseline"]:
        parser.error(f"--variants: baseline first, then any of {', '.join(VARIANTS[1:])}")
    return args


def run_variant(variant: str, args: argparse.Namespace, tmp: Path,
                target: float | None, min_wall: float = 0.0) -> dict:
    """One worker process; its curve."""
    out = tmp / f"{variant}.json"
    argv = [sys.executable, str(WORKER), "--variant", variant, "--out", str(out),
            "--steps", str(args.steps), "--eval_every", str(args.eval_every),
            *args.worker_args.split()]
    if target is not None:
        argv += ["--target", repr(target), "--stop_at_target", "--min_wall", repr(min_wall),
                 "--max_steps", str(int(args.steps * args.max_factor))]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29700 + VARIANTS.index(variant)),
               OMP_NUM_THREADS="2")
    print(f"-- {variant}", flush=True)
    done = subprocess.run(argv, env=env, cwd=ROOT, timeout=args.timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
        return {"variant": variant, "status": f"exit {done.returncode}: {tail[0]}"}
    return {**json.loads(out.read_text()), "status": "ok"}


def crossing(curve: list[dict], target: float, key: str) -> float | None:
    """``key`` (wall seconds or tokens) where the validation loss first reaches
    ``target``, linearly interpolated between evaluations; None when it never does."""
    previous = {"val_loss": float("inf"), key: 0.0}
    for point in curve:
        if point["val_loss"] <= target:
            if previous["val_loss"] == float("inf"):
                return float(point[key])
            span = previous["val_loss"] - point["val_loss"]
            frac = (previous["val_loss"] - target) / span if span > 0 else 1.0
            return previous[key] + frac * (point[key] - previous[key])
        previous = point
    return None


def loss_at(curve: list[dict], key: str, value: float) -> float | None:
    """The validation loss at ``key`` = ``value`` (interpolated); None beyond the curve."""
    for a, b in itertools.pairwise(curve):
        if a[key] <= value <= b[key]:
            frac = (value - a[key]) / (b[key] - a[key]) if b[key] > a[key] else 1.0
            return a["val_loss"] + frac * (b["val_loss"] - a["val_loss"])
    return None


def summarize(result: dict, base: dict, steps: int) -> dict:
    """A table row from a worker's curve and the baseline's."""
    if result["status"] != "ok":
        return {"variant": result["variant"], "status": result["status"]}
    curve, base_curve = result["curve"], base["curve"]
    target = base_curve[-1]["val_loss"]
    base_wall = base_curve[-1]["wall_s"]
    wall = crossing(curve, target, "wall_s")
    at_steps = next((p["val_loss"] for p in curve if p["step"] == steps), None)
    return {"variant": result["variant"], "status": "ok", "target": target,
            "wall_to_target_s": wall, "tokens_to_target": crossing(curve, target, "tokens"),
            "speedup": None if wall is None else base_wall / wall,
            "val_at_steps": at_steps,
            "val_at_base_wall": loss_at(curve, "wall_s", base_wall),
            "s_per_step": curve[-1]["wall_s"] / curve[-1]["step"],
            "steps_run": curve[-1]["step"], "curve": curve}


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict]) -> list[str]:
    lines = ["| variant | s/step | time to target | speed-up | tokens to target | "
             "val loss at the baseline's steps | at its wall time |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| {row['variant']} | {row['status']} | | | | | |")
            continue
        tokens = row["tokens_to_target"]
        lines.append(f"| {row['variant']} | {row['s_per_step']:.3f} | "
                     f"{_num(row['wall_to_target_s'], '.1f')} s | "
                     f"{_num(row['speedup'], '.2f')}x | "
                     f"{'-' if tokens is None else f'{tokens / 1e6:.2f}M'} | "
                     f"{_num(row['val_at_steps'], '.4f')} | "
                     f"{_num(row['val_at_base_wall'], '.4f')} |")
    return lines


def verdicts(rows: list[dict]) -> list[str]:
    both = next((r for r in rows if r["variant"] == "both" and r["status"] == "ok"), None)
    if both is None:
        return ["target: not measured (no 'both' row)"]
    target = rows[0]["target"]
    speed = both["speedup"]
    met = speed is not None and speed >= SPEEDUP_TARGET
    at_wall = both["val_at_base_wall"]
    no_worse = at_wall is not None and at_wall <= target
    return [f"target: both switches >= {SPEEDUP_TARGET}x less wall time to the baseline's "
            f"validation loss {target:.4f}: {_num(speed, '.2f')}x -> "
            f"{'MET' if met else 'NOT MET'}",
            f"target: no worse loss for the same wall time: {_num(at_wall, '.4f')} vs "
            f"{target:.4f} -> {'MET' if no_worse else 'NOT MET'}"]


def main() -> None:
    args = parse_args()
    run = Run("data_efficiency", {k: (str(v) if isinstance(v, Path) else v)
                                  for k, v in vars(args).items()})
    rows = []
    with tempfile.TemporaryDirectory(prefix="data-efficiency-") as tmp:
        base = run_variant("baseline", args, Path(tmp), None)
        if base["status"] != "ok":
            sys.exit(f"baseline failed: {base['status']}")
        rows.append(summarize(base, base, args.steps))
        target, wall = base["curve"][-1]["val_loss"], base["curve"][-1]["wall_s"]
        for variant in args.variants[1:]:
            rows.append(summarize(run_variant(variant, args, Path(tmp), target, wall), base,
                                  args.steps))
    print(f"1 rank x 2 threads on {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.2f}' for x in run.loadavg_start)} at the start, "
          f"{' '.join(f'{x:.2f}' for x in loadavg())} at the end")
    lines = table(rows)
    print("\n".join(lines))
    print()
    print("\n".join(verdicts(rows)))
    run.write(rows, lines, args.results)


if __name__ == "__main__":
    main()
