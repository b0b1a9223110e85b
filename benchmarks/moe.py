"""MoE GPT on 4 CPU ranks: deepshard's MoE against DeepSpeed 0.19.8's, expert parallelism 2 and 4.

The model, data and loop are ``benchmarks/moe_worker.py``'s: a GPT (vocabulary 512, width
256, 4 blocks, sequence 128) whose blocks 1 and 3 have a feed-forward MoE of 8 experts
(top-2, each a 256 -> 1024 -> 256 GELU MLP; capacity factor 1, tokens dropped past the
capacity), micro-batch 4 per rank, AdamW at ZeRO stage 2. Each row starts 4 fresh worker
processes (gloo, one thread each, RANK/WORLD_SIZE/MASTER_* set directly, no launcher),
one row after another: deepshard with this checkout's Python, DeepSpeed with
``--deepspeed-python`` (default /tmp/dsvenv/bin/python) and ``DS_ACCELERATOR=cpu``; a
DeepSpeed row is skipped, with the reason, where that Python cannot import deepspeed.

Per row: the step time (rank 0's median over the ``--steps`` timed steps after
``--warmup``; every step has a barrier before and after it, so it is every rank's),
tokens/s (the 4 ranks' 2048 tokens per step over it), each rank's peak RSS
(``ru_maxrss``), and the bytes the all-to-alls sent to other ranks per timed step and
rank (``torch.distributed.all_to_all_single`` is wrapped in the worker; both libraries
exchange tokens with it) against the theory:

* DeepSpeed sends its whole padded buffer: per MoE layer and step, 4 exchanges (dispatch
  and combine, forward and backward) of ``E * C * M`` fp32 values, ``(ep - 1) / ep`` of
  them to other ranks, with the capacity ``C = max(ceil(S / E * 2 * capacity_factor), 4)``
  for ``S`` tokens per rank (128 here: ``E * C = k * S``);
* deepshard sends only the routes the capacity kept that go to another rank (the
  worker reads their count from the layers: ``sent_rows``): 4 exchanges of that many
  rows of ``M`` fp32 values, plus the per-expert counts (``E - E / ep`` int64 values).

Targets (printed with the table): deepshard's tokens/s at least 1.3x DeepSpeed's at each
ep, its highest per-rank peak RSS no higher than DeepSpeed's.

    make bench-moe                       # = python benchmarks/moe.py
    python benchmarks/moe.py [--eps 2,4] [--impls deepshard,deepspeed] [--steps 3]
                             [--warmup 1] [--timeout 300] [--results DIR]

The record goes to ``benchmarks/results/moe.json`` (``benchmarks/record.py``); ``python
benchmarks/plot.py --only moe`` draws ``docs/plots/moe.png`` from it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "moe_worker.py"
sys.path.insert(0, str(HERE))

from moe_worker import (  # noqa: E402  (the model constants; this imports torch)
    CAPACITY_FACTOR,
    EXPERTS,
    MICRO_BATCH,
    MIN_CAPACITY,
    SEQ,
    TOP_K,
    WIDTH,
)
from record import RESULTS, Run, loadavg  # noqa: E402
from train import DEFAULT_DS_PYTHON, cpu_model, deepspeed_version, error_line, wait_all  # noqa: E402

WORLD = 4
SPEED_TARGET = 1.3
FP32, INT64 = 4, 8
PASSES = 4
"""All-to-alls of tokens per MoE layer and step: dispatch and combine, forward and backward."""
LABEL = {"deepshard": "deepshard", "deepspeed": "DeepSpeed"}


# ---------------------------------------------------------------- running a row

def run_row(impl: str, ep: int, args: argparse.Namespace, tmp: Path) -> dict:
    """Start the row's 4 ranks, wait, and read their records: a row dict, with ``status``
    ``ok`` or ``failed: <why>``."""
    from deepshard.launcher.cli import free_port

    base = {"impl": LABEL[impl], "ep": ep}
    python = args.deepspeed_python if impl == "deepspeed" else sys.executable
    out = tmp / f"{impl}-ep{ep}"
    env = {**os.environ, "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    argv = [python, str(WORKER), "--impl", impl, "--ep", str(ep), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--out", str(out)]
    print(f"running {LABEL[impl]} ep {ep} ...", file=sys.stderr, flush=True)
    procs = []
    for rank in range(WORLD):
        with open(tmp / f"{impl}-ep{ep}.{rank}.err", "w") as err:
            procs.append(subprocess.Popen(
                argv, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=ROOT,
                stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL))
    codes = wait_all(procs, args.timeout)
    if all(code in (None, 0) for code in codes) and None in codes:
        return {**base, "status": f"failed: timed out after {args.timeout:.0f} s"}
    failed = [rank for rank, code in enumerate(codes) if code != 0]
    if failed:
        line = error_line(tmp / f"{impl}-ep{ep}.{failed[0]}.err")
        return {**base, "status": f"failed: {line} (rank {failed[0]}, exit {codes[failed[0]]})"}
    try:
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    except (OSError, ValueError) as exc:
        return {**base, "status": f"failed: no result: {exc}"}
    return {**base, **summarize(ranks)}


def summarize(ranks: list[dict]) -> dict:
    """The timed window's figures of one row, from its ranks' records."""
    first = ranks[0]
    timed = first["steps"][first["timed_from"]:]
    times = [s["s"] for s in timed]
    n = len(timed)
    step_s = statistics.median(times)
    a2a = [r["a2a_bytes"] / n for r in ranks]
    sent = [[s["sent_rows"] for s in r["steps"][r["timed_from"]:]] for r in ranks]
    return {"status": "ok", "s_per_step": step_s, "step_s": times, "timed_steps": n,
            "tokens_per_step": first["tokens_per_step"],
            "tokens_per_s": first["tokens_per_step"] / step_s,
            "peak_rss_mib": [r["peak_rss_kib"] / 1024 for r in ranks],
            "a2a_bytes_per_step_by_rank": a2a, "a2a_bytes_per_step": statistics.mean(a2a),
            "a2a_calls_per_step": first["a2a_calls"] / n,
            "sent_rows_per_step_by_rank": None if None in sent[0] else
            [statistics.mean(s) for s in sent],
            "routed_per_step": statistics.mean(s["routed"] for s in timed),
            "losses": [s["loss"] for s in first["steps"]], "moe_layers": first["moe_layers"],
            "threads_per_rank": first["threads"]}


# ---------------------------------------------------------------- theory

def capacity() -> int:
    """DeepSpeed's top-2 capacity per expert for one rank's tokens (``_capacity``)."""
    tokens = MICRO_BATCH * SEQ
    return max(math.ceil(tokens / EXPERTS * CAPACITY_FACTOR * TOP_K), MIN_CAPACITY)


def theory_bytes(row: dict) -> float | None:
    """The all-to-all bytes one rank should send to the others per step (module doc)."""
    if row["status"] != "ok":
        return None
    ep, layers = row["ep"], row["moe_layers"]
    remote = (ep - 1) / ep
    if row["impl"] == "DeepSpeed":
        return PASSES * layers * EXPERTS * capacity() * WIDTH * FP32 * remote
    sent = row["sent_rows_per_step_by_rank"]
    if sent is None:
        return None
    counts = layers * (EXPERTS - EXPERTS // ep) * INT64
    return PASSES * statistics.mean(sent) * WIDTH * FP32 + counts


def add_ratios(rows: list[dict]) -> None:
    """``theory_bytes``, and on deepshard's rows ``vs_deepspeed`` (tokens/s ratio) and
    ``rss_vs_deepspeed`` (highest peak over DeepSpeed's), against the same ep."""
    ds = {r["ep"]: r for r in rows if r["impl"] == "DeepSpeed" and r["status"] == "ok"}
    for r in rows:
        r["theory_bytes_per_step"] = theory_bytes(r)
        ref = ds.get(r["ep"])
        ok = ref is not None and r["status"] == "ok" and r["impl"] == "deepshard"
        r["vs_deepspeed"] = r["tokens_per_s"] / ref["tokens_per_s"] if ok else None
        r["rss_vs_deepspeed"] = (max(r["peak_rss_mib"]) / max(ref["peak_rss_mib"])
                                 if ok else None)


# ---------------------------------------------------------------- report

def table(rows: list[dict]) -> list[str]:
    """The markdown table: one line per (ep, implementation)."""
    lines = ["| ep | MoE | s/step (median) | tokens/s | vs DeepSpeed | peak RSS per rank (MiB) "
             "| all-to-all MiB/step/rank | theory |",
             "|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        head = f"| {r['ep']} | {r['impl']} |"
        if r["status"] != "ok":
            lines.append(f"{head} - | - | - | {r['status']} | - | - |")
            continue
        speed = f"{r['vs_deepspeed']:.2f}x" if r["vs_deepspeed"] else \
            "1" if r["impl"] == "DeepSpeed" else "-"
        rss = " / ".join(f"{m:.0f}" for m in r["peak_rss_mib"])
        theory = r["theory_bytes_per_step"]
        lines.append(f"{head} {r['s_per_step']:.3f} | {r['tokens_per_s']:.0f} | {speed} | {rss} "
                     f"| {r['a2a_bytes_per_step'] / 2**20:.3f} | "
                     + (f"{theory / 2**20:.3f} |" if theory else "- |"))
    return lines


def verdicts(rows: list[dict]) -> list[str]:
    """The two targets per ep, met or missed, as measured."""
    out = []
    for r in rows:
        if r["vs_deepspeed"] is None:
            continue
        out.append(f"ep {r['ep']}: tokens/s {r['vs_deepspeed']:.2f}x DeepSpeed's (target >= "
                   f"{SPEED_TARGET}x): " + ("met" if r["vs_deepspeed"] >= SPEED_TARGET
                                            else "MISSED"))
        out.append(f"ep {r['ep']}: highest peak RSS {r['rss_vs_deepspeed']:.2f}x DeepSpeed's "
                   "(target <= 1): " + ("met" if r["rss_vs_deepspeed"] <= 1 else "MISSED"))
    return out


def notes(rows: list[dict]) -> list[str]:
    """Per row: the timed steps and the losses, to show both trained the same model."""
    return [f"{r['impl']} ep {r['ep']}: timed steps "
            f"{', '.join(f'{t:.2f}' for t in r['step_s'])} s; losses "
            f"{', '.join(f'{x:.4f}' for x in r['losses'])}"
            for r in rows if r["status"] == "ok"]


# ---------------------------------------------------------------- main

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eps", default="2,4", help="expert-parallel sizes (divide 4 and 8)")
    parser.add_argument("--impls", default="deepshard,deepspeed")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per row")
    parser.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON)
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder for the run's record, moe.json")
    args = parser.parse_args()
    try:
        args.eps = [int(x) for x in args.eps.split(",") if x]
    except ValueError:
        parser.error(f"--eps {args.eps!r}: comma-separated integers, e.g. 2,4")
    args.impls = [x for x in args.impls.split(",") if x]
    bad = [x for x in args.impls if x not in LABEL] + [str(e) for e in args.eps
                                                       if e < 1 or WORLD % e or EXPERTS % e]
    if bad:
        parser.error(f"unknown implementation or ep size {bad[0]!r} (ep divides {WORLD} "
                     f"and {EXPERTS})")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def settings(args: argparse.Namespace, ds_label: str | None) -> dict:
    return {"eps": args.eps, "impls": args.impls, "steps": args.steps, "warmup": args.warmup,
            "world": WORLD, "threads_per_rank": 1, "zero_stage": 2, "optimizer": "AdamW",
            "model": f"GPT vocab 512, width {WIDTH}, 4 blocks, seq {SEQ}; MoE in blocks 1 "
                     f"and 3: {EXPERTS} experts top-{TOP_K}, expert {WIDTH}->1024->{WIDTH}",
            "micro_batch": MICRO_BATCH, "capacity_factor": CAPACITY_FACTOR,
            "capacity": capacity(), "deepspeed": ds_label,
            "s_per_step": "rank 0's median of the timed steps (barrier before and after)",
            "a2a_bytes": "bytes all_to_all_single sent to other ranks, per timed step, "
                         "mean over ranks"}


def run_rows(args: argparse.Namespace, ds_missing: str) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        for ep in args.eps:
            for impl in args.impls:
                if impl == "deepspeed" and ds_missing:
                    rows.append({"impl": LABEL[impl], "ep": ep,
                                 "status": f"skipped: {ds_missing}"})
                    continue
                rows.append(run_row(impl, ep, args, Path(tmp)))
                if rows[-1]["status"] != "ok":
                    print(f"  {rows[-1]['status']}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    args = parse_args()
    ds_label, ds_missing = (deepspeed_version(args.deepspeed_python)
                            if "deepspeed" in args.impls else (None, ""))
    run = Run("moe", settings(args, ds_label))
    rows = run_rows(args, ds_missing)
    add_ratios(rows)
    print(f"{WORLD} CPU ranks x 1 thread (gloo) on {os.cpu_count()} cores ({cpu_model()}), "
          f"load average {' '.join(f'{x:.2f}' for x in run.loadavg_start)} at the start, "
          f"{' '.join(f'{x:.2f}' for x in loadavg())} at the end; {args.steps} timed steps "
          f"after {args.warmup} warm-up; {ds_label or 'DeepSpeed: ' + ds_missing}")
    lines = table(rows)
    print("\n".join(lines))
    print()
    print("\n".join(verdicts(rows)))
    print()
    print("\n".join(notes(rows)))
    run.write(rows, lines, args.results)


if __name__ == "__main__":
    main()
