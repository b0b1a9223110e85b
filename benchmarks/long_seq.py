"""Long sequences: the longest sequence a tiny-width, many-token Llama trains at under a
per-rank RSS budget, with Ulysses sequence parallelism and ALST's tiling, on CPU ranks.

The model (``long_seq_worker.MODEL``): a transformers ``LlamaForCausalLM`` built from its
config, hidden 64, 2 layers, 4 heads, intermediate 256, vocab 32000, untied head (4.2M
parameters, 4.1M of them in the embedding and the head), fp32, sdpa attention, ZeRO stage 0,
AdamW; batch 1, seeded random tokens. At these widths the ``[tokens, 32000]`` logits
dominate: ~390 KB a token untiled against ~10 KB a token for the rest.

Per sequence-parallel size P (1: no SP, one rank; 2 and 4: Ulysses over P gloo ranks of one
thread each) deepshard's worker (``long_seq_worker.py``) searches the longest length that
fits: doubling from ``64 P`` tokens, then ``--bisections`` bisection steps; a length fits when
every rank's peak RSS during a training step (``VmHWM`` after a warm step, reset between
lengths) stays within the budget. The budget is the first no-SP worker's RSS after its warm
step (torch, transformers, the model, its gradients and AdamW state: ~435 MiB) plus
``--headroom-mib``, the same for every rank and configuration (``--budget-mib`` fixes it).
Tiled (``sequence_parallel``: ``tiled_mlp_compute``, ``tiled_logits_loss``, logits tiles of
``--logits-tile`` tokens), the search starts at the untiled maximum and stops at
``--tiled-cap`` times it (shown as ``>=``): at 25x the untiled length a step takes minutes
on a loaded 2-core machine. The parent watches every worker's RSS (psutil) and kills a
job past ``--kill-factor`` x the budget (it protects the shared machine; the budget itself
is judged on the workers' own peaks).

Then DeepSpeed 0.19.8 (``--deepspeed-python``, default /tmp/dsvenv/bin/python,
``DS_ACCELERATOR=cpu``) trains the same model at deepshard's maximum lengths for P = 2 and
4, untiled and tiled, with its ``UlyssesSPAttentionHF``, ``TiledMLP`` and
``TiledFusedLogitsLoss`` (see the worker's docstring); deepshard is timed at the same
lengths right before it (``--steps`` steps after a warm step, a barrier around each).
Tokens per second: the sequence length over rank 0's mean step time.

Targets: max length at SP 2 >= 1.8x and at SP 4 >= 3.5x the no-SP length; tiling >= 2x the
untiled length; deepshard's tokens/s >= DeepSpeed's.

    make bench-long-seq                          # = python benchmarks/long_seq.py
    python benchmarks/long_seq.py [--sp 1,2,4] [--headroom-mib 96] [--budget-mib M]
                                  [--tiled-cap 4] [--logits-tile 64] [--steps 2]
                                  [--bisections 2] [--no-deepspeed] [--results DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "long_seq_worker.py"
sys.path.insert(0, str(HERE))

from long_seq_worker import MODEL, RESULT_TAG  # noqa: E402
from record import RESULTS, Run  # noqa: E402
from train import DEFAULT_DS_PYTHON, deepspeed_version, error_line  # noqa: E402


def _env(world: int, port: int, foreign: bool) -> dict:
    env = {**os.environ, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if foreign:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _watch(procs: list, limit_mib: float, timeout: float) -> str:
    """Wait for ``procs``; kill them all when one fails, passes ``limit_mib`` of RSS or
    the timeout passes. Returns why they were killed, "" when all exited 0."""
    import psutil

    deadline, why = time.monotonic() + timeout, ""
    handles = [psutil.Process(p.pid) for p in procs]
    while not why:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return ""
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            why = f"rank {failed[0]} exited with {codes[failed[0]]}"
        elif time.monotonic() > deadline:
            why = f"timed out after {timeout:.0f} s"
        for rank, h in enumerate(handles):
            try:
                rss = h.memory_info().rss / 2**20
            except psutil.Error:
                continue
            if limit_mib and rss > limit_mib:
                why = f"rank {rank} passed {limit_mib:.0f} MiB of RSS (watchdog)"
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
    return why


def launch(args: argparse.Namespace, lib: str, world: int, jobs: str,
           budget: float) -> tuple[list[dict], str]:
    """One worker job list on ``world`` ranks: (rank 0's result lines, failure or "")."""
    from deepshard.launcher.cli import free_port

    foreign = lib == "deepspeed"
    python = args.deepspeed_python if foreign else sys.executable
    argv = [python, str(WORKER), lib, "--jobs", jobs, "--steps", str(args.steps),
            "--budget-mib", str(budget), "--logits-tile", str(args.logits_tile),
            "--tiled-cap", str(args.tiled_cap), "--bisections", str(args.bisections),
            "--headroom-mib", str(args.headroom_mib)]
    env = _env(world, free_port("127.0.0.1"), foreign)
    print(f"running {lib} on {world} rank(s): {jobs} ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-long-seq-") as tmp:
        procs = []
        for rank in range(world):
            with open(f"{tmp}/{rank}.out", "w") as out, open(f"{tmp}/{rank}.err", "w") as err:
                procs.append(subprocess.Popen(
                    argv, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=ROOT,
                    stdout=out, stderr=err, stdin=subprocess.DEVNULL))
        why = _watch(procs, budget * args.kill_factor if budget else 0.0, args.timeout)
        lines = Path(f"{tmp}/0.out").read_text(errors="replace").splitlines()
        if why and "exited" in why:
            rank = int(why.split()[1])
            why = f"{why}: {error_line(Path(f'{tmp}/{rank}.err'))}"
    results = [json.loads(x[len(RESULT_TAG):]) for x in lines if x.startswith(RESULT_TAG)]
    for r in results:
        if r.get("job") in ("search", "time"):
            print(f"  {lib} sp{world} {'tiled' if r['tiled'] else 'untiled'} "
                  f"{r['length']:>6} tokens: peak {r['group_peak_rss_mib']:.0f} MiB"
                  f"{'' if r['fits'] else ' (over)'}, {statistics.mean(r['step_s']):.2f} s",
                  file=sys.stderr, flush=True)
    return results, why


def _found(results: list[dict], tiled: bool) -> dict | None:
    return next((r for r in results if r.get("job") == "found" and r["tiled"] == tiled), None)


def _timed(results: list[dict], tiled: bool) -> dict | None:
    return next((r for r in results if r.get("job") == "time" and r["tiled"] == tiled), None)


def _mean(r: dict | None) -> float | None:
    return statistics.mean(r["step_s"]) if r and r.get("step_s") else None


def measure_sp(args: argparse.Namespace, sp: int, budget: float) -> tuple[dict, float]:
    """deepshard's search (and, for sp > 1, its timing and DeepSpeed's) at one SP size:
    (per tiling the figures of the row, the budget used)."""
    jobs = f"search:u:{64 * sp},search:t:u"
    if sp > 1 and args.deepspeed:
        jobs += ",time:u:found,time:t:found"
    results, why = launch(args, "deepshard", sp, jobs, budget)
    for r in results:
        if r.get("job") == "budget":
            budget = r["budget_mib"]
    rows = {}
    for tiled in (False, True):
        found = _found(results, tiled)
        probes = [r for r in results if r.get("job") == "search" and r["tiled"] == tiled]
        fit = [r for r in probes if r["fits"] and found and r["length"] == found["length"]]
        rows[tiled] = {"sp": sp, "tiled": tiled, "status": "ok" if found else
                       f"failed: {why or 'no result'}",
                       "max_length": found["length"] if found else None,
                       "capped": bool(found and found["length"] * 2 > found["cap"]
                                      and tiled),
                       "peak_rss_mib": fit[0]["group_peak_rss_mib"] if fit else None,
                       "probes": [(r["length"], r["group_peak_rss_mib"], r["fits"])
                                  for r in probes],
                       "deepshard": _timed(results, tiled)}
    if sp > 1 and args.deepspeed and all(rows[t]["max_length"] for t in rows):
        jobs = ",".join(f"time:{'t' if t else 'u'}:{rows[t]['max_length']}" for t in rows)
        ds, why = launch(args, "deepspeed", sp, jobs, 0.0)
        for tiled in rows:
            rows[tiled]["deepspeed"] = _timed(ds, tiled) or {"failed": why or "no result"}
    return rows, budget


def _fmt(value: float | None, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def summarize(rows: list[dict]) -> list[dict]:
    """The table's numbers per row: ratios to no SP and to untiled, step time, tokens/s."""
    base = {r["tiled"]: r["max_length"] for r in rows if r["sp"] == 1 and not r["capped"]}
    untiled = {r["sp"]: r["max_length"] for r in rows if not r["tiled"]}
    out = []
    for r in rows:
        mine, theirs = r.get("deepshard"), r.get("deepspeed")
        length = r["max_length"]
        s_mine = _mean(mine)
        s_theirs = _mean(theirs) if theirs and "step_s" in theirs else None
        out.append({
            "sp": r["sp"], "tiled": r["tiled"], "status": r["status"],
            "max_length": length, "capped": r["capped"], "peak_rss_mib": r["peak_rss_mib"],
            "probes": r["probes"],
            "x_no_sp": length / base[r["tiled"]] if length and base.get(r["tiled"]) else None,
            "x_untiled": length / untiled[r["sp"]] if r["tiled"] and length
            and untiled.get(r["sp"]) else None,
            "deepshard_s": s_mine, "deepshard_tok_s": length / s_mine if s_mine else None,
            "deepshard_step_s": mine["step_s"] if mine else None,
            "deepshard_rss_mib": mine["group_peak_rss_mib"] if mine else None,
            "deepspeed_s": s_theirs,
            "deepspeed_tok_s": length / s_theirs if s_theirs else None,
            "deepspeed_step_s": theirs["step_s"] if s_theirs else None,
            "deepspeed_rss_mib": theirs["group_peak_rss_mib"] if s_theirs else None,
            "deepspeed_failed": theirs.get("failed") if theirs and not s_theirs else None,
            "speedup": s_theirs / s_mine if s_mine and s_theirs else None})
    return out


def table(rows: list[dict], budget: float) -> list[str]:
    lines = [f"per-rank RSS budget {budget:.0f} MiB",
             "| ranks (SP) | tiling | max length | x no SP | x untiled | peak RSS/rank MiB | "
             "deepshard s/step | tok/s | DeepSpeed s/step | tok/s | DeepSpeed RSS/rank MiB "
             "| tok/s vs DeepSpeed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ge = ">= " if r["capped"] else ""
        length = f"{ge}{r['max_length']}" if r["max_length"] else r["status"]
        ds = r["deepspeed_failed"] or _fmt(r["deepspeed_s"])
        lines.append(
            f"| {r['sp']} ({'SP ' + str(r['sp']) if r['sp'] > 1 else 'no SP'}) | "
            f"{'tiled MLP + logits' if r['tiled'] else 'none'} | {length} | "
            f"{ge if r['x_no_sp'] else ''}{_fmt(r['x_no_sp'], '.2f')} | "
            f"{ge if r['x_untiled'] else ''}{_fmt(r['x_untiled'], '.2f')} | "
            f"{_fmt(r['peak_rss_mib'], '.0f')} | {_fmt(r['deepshard_s'])} | "
            f"{_fmt(r['deepshard_tok_s'], '.0f')} | {ds} | {_fmt(r['deepspeed_tok_s'], '.0f')} "
            f"| {_fmt(r['deepspeed_rss_mib'], '.0f')} | {_fmt(r['speedup'], '.2f')} |")
    return lines


def targets(rows: list[dict]) -> list[str]:
    """One line per target, met or not, from the rows."""
    out = []
    for sp, want in ((2, 1.8), (4, 3.5)):
        r = next((x for x in rows if x["sp"] == sp and not x["tiled"]), None)
        if r and r["x_no_sp"]:
            out.append(f"max length at SP {sp}: {r['x_no_sp']:.2f}x no SP (target >= {want}): "
                       f"{'met' if r['x_no_sp'] >= want else 'NOT met'}")
    for r in (x for x in rows if x["tiled"] and x["x_untiled"]):
        bound = ">= " if r["capped"] else ""
        out.append(f"tiling at SP {r['sp']}: {bound}{r['x_untiled']:.2f}x untiled (target >= 2): "
                   f"{'met' if r['x_untiled'] >= 2 else 'NOT met'}")
    for r in (x for x in rows if x["speedup"]):
        out.append(f"tokens/s at SP {r['sp']} {'tiled' if r['tiled'] else 'untiled'}: "
                   f"{r['speedup']:.2f}x DeepSpeed's (target >= 1): "
                   f"{'met' if r['speedup'] >= 1 else 'NOT met'}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", default="1,2,4")
    parser.add_argument("--headroom-mib", type=float, default=96.0)
    parser.add_argument("--budget-mib", type=float, default=0.0)
    parser.add_argument("--tiled-cap", type=int, default=4)
    parser.add_argument("--logits-tile", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--bisections", type=int, default=1)
    parser.add_argument("--kill-factor", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON)
    parser.add_argument("--no-deepspeed", dest="deepspeed", action="store_false")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sp.split(",")]
    if sizes[0] != 1:
        parser.error("--sp must start with 1 (the no-SP length every ratio divides by)")
    ds_version, why_not = deepspeed_version(args.deepspeed_python) if args.deepspeed \
        else (None, "--no-deepspeed")
    if args.deepspeed and not ds_version:
        print(f"DeepSpeed rows skipped: {why_not}", file=sys.stderr)
        args.deepspeed = False
    run = Run("long_seq", {"model": MODEL, "sp_sizes": sizes, "headroom_mib": args.headroom_mib,
                           "tiled_cap": args.tiled_cap, "logits_tile": args.logits_tile,
                           "steps": args.steps, "bisections": args.bisections,
                           "threads_per_rank": 1, "deepspeed": ds_version or why_not})
    rows, budget = [], args.budget_mib
    for sp in sizes:
        found, budget = measure_sp(args, sp, budget)
        rows += [found[False], found[True]]
    summary = summarize(rows)
    lines = [*table(summary, budget), "", *targets(summary)]
    print("\n".join(lines))
    run.settings["budget_mib"] = budget
    run.write(summary, lines, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
