"""Step time per parallel layout (data, pipeline, tensor) of the example GPT on CPU ranks, and
the pipeline bubble measured against the 1F1B theory.

Layouts (4 ranks, one thread each, gloo; P x D x T = pipe x data x tensor), each through
``deepshard.initialize`` with the same global batch (``--global-batch`` samples of
``--micro`` per micro-batch, so the gradient accumulation m = global / (micro x D)):

    dp4      1 x 4 x 1   the plain GPT (examples/gpt.py), engine(x, y) / backward / step
    pp2-dp2  2 x 2 x 1   examples/gpt_pipe.py's PipelineModule, engine.train_batch
    tp2-dp2  1 x 2 x 2   the plain GPT, "tensor_parallel": {"autotp_size": 2} (AutoTP)
    pp2-tp2  2 x 1 x 2   the PipelineModule with AutoTP in each stage
    pp4      4 x 1 x 1   the PipelineModule over 4 stages

Every layout starts from the same weights (``GPT(cfg)`` after ``torch.manual_seed(0)``;
gpt_pipe copies them into the stages) and sees the same global batches, so the loss of
step 1 is the same in every row up to rounding; the table shows it, and the last loss.

The bubble: after each ``train_batch`` the engine reports ``last_batch_timing`` =
``{"total_s", "pipe_s", "busy_s", "forward_s", "backward_s"}`` (wall seconds of the
batch, of its 1F1B schedule, and in Forward/Backward). A stage's measured bubble is
``1 - busy/wall`` (median over the timed steps, mean over the stage's data/tensor ranks),
set against the theory ``(P - 1) / (m + P - 1)`` (``schedule.bubble_fraction``: equal
stages, free communication) and against the 1F1B simulator run with each stage's measured
compute per micro-batch (``schedule.simulate``: what the stage imbalance alone explains).
Three walls, three columns:

* ``total_s``: the whole batch, gradient reduction and optimizer step included (the theory
  leaves them out). The batch ends with the loss broadcast from the last stage, which
  returns on every stage together, so this window is the same on every stage.
* the pipeline span: the step's largest ``pipe_s`` over the pipeline's ranks, i.e. the
  schedule's wall time from the common start (a barrier) until the last stage to finish
  it. The same window on every stage, without the reduction and the step: what the
  theory describes.
* each rank's own ``pipe_s``: shown for completeness; the last stage's schedule ends
  before the first stage's last backward, so its own window is short and its bubble low.

The bubble sweep's model (``--bubble-size``). The theory assumes stages that compute the
same, and a bubble is a small difference of large numbers: a stage lighter than the
slowest by a fraction d idles about d more of the batch, i.e. about ``m x d`` of the
theory, relative (at m = 8, stages 2% apart put the lighter one 16% off theory). The
reference GPT cannot be cut in two equal halves of whole layers (its 8192-vocab head and
loss cost ~1.35 blocks: embedding + 3 blocks | 3 blocks + head is 3 | 4.35 blocks' worth,
and moving a block gives 4 | 3.35). So the sweep
defaults to ``balanced``: the reference GPT with the byte vocabulary its corpus really
uses (``vocab_size`` 256; 6 blocks, d_model 512), split ``"uniform"`` into embedding + 3
blocks | 3 blocks + head. The embedding and the 256-way head cost 1% and 5% of a block,
and the two stages hold nearly the same parameters, so their compute per micro-batch is
equal within noise: the table shows it (fwd+bwd per micro-batch by stage, with their
max/min ratio). ``--bubble-size reference`` sweeps the unequal reference split
(``--partition-method``, ``type:Block`` by default) instead, where the simulator column
shows that the imbalance explains the gap to the theory.

Honest caveats: 4 single-threaded ranks on a 2-core machine oversubscribe the CPU (two
ranks per core), so the 4-rank rows time-share cores: a rank waiting in a receive frees
its core for a peer, which inflates ``busy`` and hides the bubble. ``--bubble-stages 2``
(the default) therefore sweeps m over pipelines of P ranks alone (P = 2 on 2 ranks: no
oversubscription by this benchmark, though other load on the machine still counts).

    python benchmarks/parallel.py [--size small|reference] [--steps 5] [--warmup 2]
                                  [--layouts dp4,pp2-dp2,...] [--bubble-stages 2,4]
                                  [--bubble-m 1,2,4,8] [--bubble-size balanced|reference]
                                  [--partition-method type:Block]
                                  [--json out.json]

The layouts' pipelines (and ``--bubble-size`` other than ``balanced``) are split with
``partition_method="type:Block"`` by default (blocks balanced, the
embedding with the first, the head with the last): ``"parameters"`` counts the embedding's
many parameters as work and, at P = 4, gives it a stage of its own that idles.

``--size small`` (the default: 4 layers, d_model 256, 4 heads, vocab 4096, seq 128; 5.3M
parameters) keeps a whole run to a few minutes on 2 cores; ``--size reference`` is
``GPTConfig()`` (27.4M parameters, about 7x slower per sample). Workers are started
directly with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, as ``benchmarks/train.py`` does; a
layout whose ranks fail (say, before the pipeline engine exists) is a row
``failed: <error line>`` and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from record import RESULTS, Run  # noqa: E402
from train import RESULT_TAG, cpu_model, deepshard_missing, error_line, wait_all  # noqa: E402

SEED = 1234
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}
SIZES = {
    "small": {"n_layer": 4, "d_model": 256, "n_head": 4, "vocab_size": 4096},
    "reference": {},
    "balanced": {"n_layer": 6, "vocab_size": 256},
}
"""``--size``/``--bubble-size`` -> ``GPTConfig`` fields; "balanced" is the bubble sweep's
model (see the module docstring)."""


@dataclass(frozen=True)
class RunSpec:
    """One launch: a layout of ``world`` ranks and its batch shape (JSON for the workers)."""

    name: str
    world: int
    pipe: int
    tensor: int
    micro: int
    accumulation: int
    """Micro-batches per step (the pipeline's m)."""
    size: str
    steps: int
    warmup: int
    partition: str = "type:Block"
    """The PipelineModule's ``partition_method``."""

    @property
    def data(self) -> int:
        return self.world // (self.pipe * self.tensor)

    def ds_config(self) -> dict:
        config = {"train_micro_batch_size_per_gpu": self.micro,
                  "gradient_accumulation_steps": self.accumulation, "optimizer": OPTIMIZER,
                  "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0}
        if self.pipe > 1:
            config["pipeline"] = {"stages": self.pipe}
        if self.tensor > 1:
            config["tensor_parallel"] = {"autotp_size": self.tensor}
        return config


LAYOUTS = {"dp4": (1, 1), "pp2-dp2": (2, 1), "tp2-dp2": (1, 2), "pp2-tp2": (2, 2),
           "pp4": (4, 1)}
"""name -> (pipe, tensor) on 4 ranks."""


def layout_spec(name: str, args: argparse.Namespace) -> RunSpec:
    pipe, tensor = LAYOUTS[name]
    data = 4 // (pipe * tensor)
    if args.global_batch % (args.micro * data):
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of --micro "
                         f"{args.micro} x {data} data-parallel ranks ({name})")
    return RunSpec(name, 4, pipe, tensor, args.micro, args.global_batch // (args.micro * data),
                   args.size, args.steps, args.warmup, args.partition_method)


# ---------------------------------------------------------------- worker (one rank)

def worker(spec: RunSpec) -> None:
    """Train ``spec.steps + spec.warmup`` steps as one rank; print one result line."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    import deepshard
    from deepshard.runtime.parallel.topology import Topology

    torch.set_num_threads(1)
    deepshard.init_distributed(verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = Topology.from_config(world, spec.pipe, spec.tensor)
    cfg = gpt.GPTConfig(**SIZES[spec.size])
    if spec.pipe > 1:
        from gpt_pipe import pipe_gpt

        model = pipe_gpt(cfg, seed=0, topology=topology, partition_method=spec.partition)
        parts = list(model.partitions())
    else:
        torch.manual_seed(0)
        model, parts = gpt.GPT(cfg), None
    engine, _, _, _ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                           config=spec.ds_config())
    if engine.dp_world_size != topology.data:
        raise RuntimeError(f"the engine's data-parallel size is {engine.dp_world_size}, the "
                           f"layout's {topology.data}: pipeline/tensor_parallel not applied?")
    dp_rank = getattr(engine, "dp_rank", topology.coord(rank).data)
    corpus = gpt.stdlib_corpus()
    times, timings, losses = [], [], []
    for step in range(spec.warmup + spec.steps):
        batches = [gpt.sample_batch(corpus, gpt.rank_indices(step, m, dp_rank, topology.data,
                                                             spec.micro, spec.accumulation),
                                    SEED, cfg.seq_len) for m in range(spec.accumulation)]
        dist.barrier()
        start = time.perf_counter()
        loss = _train_step(engine, batches, pipelined=spec.pipe > 1)
        dist.barrier()
        times.append(time.perf_counter() - start)
        timings.append(dict(getattr(engine, "last_batch_timing", None) or {}))
        total = torch.tensor(float(loss), dtype=torch.float64)
        dist.all_reduce(total)  # every rank of a replica holds its mean: the world's mean
        losses.append(total.item() / world)
    result = {"rank": rank, "coord": list(topology.coord(rank)), "parts": parts,
              "params": sum(p.numel() for p in model.parameters()),
              "step_s": times[spec.warmup:], "timing": timings[spec.warmup:], "losses": losses}
    print(RESULT_TAG + json.dumps(result), flush=True)
    dist.destroy_process_group()


def _train_step(engine, batches: list, *, pipelined: bool) -> float:
    """One optimizer step over the micro-batches; this replica's mean loss."""
    if pipelined:
        return float(engine.train_batch(data_iter=iter(batches)))
    total = 0.0
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total += float(loss.detach())
    return total / len(batches)


# ---------------------------------------------------------------- parent (launch, collect)

@dataclass(frozen=True)
class Outcome:
    """What one launch gave: each rank's result line by rank, or why there is none."""

    spec: RunSpec
    ranks: tuple[dict, ...] = ()
    why_not: str = ""


def run(spec: RunSpec, timeout: float) -> Outcome:
    """Start the ranks, wait, collect; a failure is an outcome, never an exception."""
    from deepshard.launcher.cli import free_port

    env = {**os.environ, "WORLD_SIZE": str(spec.world), "LOCAL_WORLD_SIZE": str(spec.world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker",
            json.dumps(dataclasses.asdict(spec))]
    with tempfile.TemporaryDirectory(prefix=f"bench-{spec.name}-") as tmp:
        procs = []
        for rank in range(spec.world):
            stem = Path(tmp) / str(rank)
            with open(f"{stem}.out", "w") as out, open(f"{stem}.err", "w") as err:
                procs.append(subprocess.Popen(
                    argv, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=ROOT,
                    stdout=out, stderr=err, stdin=subprocess.DEVNULL))
        codes = wait_all(procs, timeout)
        if None in codes:
            return Outcome(spec, why_not=f"failed: timed out after {timeout:.0f} s")
        # the rank that failed first, not one killed for it
        failed = sorted((code == -signal.SIGKILL, rank) for rank, code in enumerate(codes)
                        if code != 0)
        if failed:
            rank = failed[0][1]
            line = error_line(Path(tmp) / f"{rank}.err")
            return Outcome(spec, why_not=f"failed: {line} (rank {rank}, exit {codes[rank]})")
        ranks = []
        for rank in range(spec.world):
            lines = [line for line in (Path(tmp) / f"{rank}.out").read_text().splitlines()
                     if line.startswith(RESULT_TAG)]
            if not lines:
                return Outcome(spec, why_not=f"failed: rank {rank} printed no result line")
            ranks.append(json.loads(lines[-1][len(RESULT_TAG):]))
        return Outcome(spec, tuple(ranks))


# ---------------------------------------------------------------- analysis (pure)

def median_step(outcome: Outcome) -> float:
    """Rank 0's median step time."""
    return statistics.median(outcome.ranks[0]["step_s"])


def stage_bubbles(outcome: Outcome, wall: str = "total_s") -> list[float] | None:
    """Per stage: ``1 - busy / wall`` (median over steps, mean over the stage's ranks);
    None when the engine reported no such timing.

    ``wall`` is a key of the engine's timing (``"total_s"``, ``"pipe_s"``: this rank's own
    wall time), or ``"span"``: the step's largest ``pipe_s`` over all ranks, i.e. the 1F1B
    schedule's wall time for the whole pipeline, the same window on every stage (the ranks
    enter ``train_batch`` together, from a barrier)."""
    walls = _spans(outcome) if wall == "span" else None
    by_stage: dict[int, list[float]] = {}
    for result in outcome.ranks:
        fractions = [1.0 - t["busy_s"] / (walls[i] if walls else t.get(wall, 0.0))
                     for i, t in enumerate(result["timing"])
                     if (walls[i] if walls else t.get(wall)) and "busy_s" in t]
        if not fractions:
            return None
        by_stage.setdefault(result["coord"][0], []).append(statistics.median(fractions))
    return [statistics.mean(by_stage[s]) for s in sorted(by_stage)]


def _spans(outcome: Outcome) -> list[float] | None:
    """Per timed step, the largest ``pipe_s`` over the ranks (None when one lacks it)."""
    steps = zip(*(result["timing"] for result in outcome.ranks), strict=True)
    spans = [max(t.get("pipe_s") or 0.0 for t in step) for step in steps]
    return spans if spans and all(spans) else None


def stage_costs(outcome: Outcome) -> list[tuple[float, float]] | None:
    """Per stage: (forward, backward) seconds per micro-batch, medians over steps and
    ranks; busy time split 1:2 when the engine does not report the two apart."""
    m = outcome.spec.accumulation
    by_stage: dict[int, list[tuple[float, float]]] = {}
    for result in outcome.ranks:
        for t in result["timing"]:
            if "busy_s" not in t:
                return None
            fwd = t.get("forward_s", t["busy_s"] / 3)
            bwd = t.get("backward_s", t["busy_s"] - fwd)
            by_stage.setdefault(result["coord"][0], []).append((fwd / m, bwd / m))
    return [(statistics.median(f for f, _ in c), statistics.median(b for _, b in c))
            for _, c in sorted(by_stage.items())]


def simulated_bubbles(costs: list[tuple[float, float]], micro_batches: int) -> list[float]:
    """Each stage's bubble in the 1F1B simulator with these per-stage compute costs and
    free communication (what stage imbalance alone explains)."""
    from deepshard.runtime.parallel.schedule import Backward, Forward, one_f_one_b, simulate

    stages = len(costs)
    schedules = [one_f_one_b(stages, s, micro_batches) for s in range(stages)]
    duration = {}  # by action object: the same action on two stages costs differently
    for s, actions in enumerate(schedules):
        for action in actions:
            duration[id(action)] = (costs[s][0] if isinstance(action, Forward) else
                                    costs[s][1] if isinstance(action, Backward) else 0.0)
    timeline = simulate(schedules, cost=lambda a: duration[id(a)])
    return [timeline.bubble(s) for s in range(stages)]


# ---------------------------------------------------------------- report

def _fmt(values: list[float] | None, digits: int = 2) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in values) if values else "-"


def layout_table(outcomes: list[Outcome]) -> list[str]:
    ran = {o.spec.name: o for o in outcomes if o.ranks}
    baseline = median_step(ran["dp4"]) if "dp4" in ran else None
    lines = ["| layout | P x D x T | micro x m | s/step (median) | vs dp4 | min / max s | "
             "loss step 1 | last loss | bubble per stage (1 - busy/total) | theory | notes |",
             "|---|---|---|---:|---:|---|---:|---:|---|---:|---|"]
    for o in outcomes:
        s = o.spec
        shape = f"{s.pipe} x {s.data} x {s.tensor} | {s.micro} x {s.accumulation}"
        if not o.ranks:
            why = o.why_not.replace("|", "\\|")
            lines.append(f"| {s.name} | {shape} | - | - | - | - | - | - | - | {why} |")
            continue
        first, step = o.ranks[0], median_step(o)
        ratio = f"{step / baseline:.2f}" if baseline else "-"
        theory = "-"
        if s.pipe > 1:
            from deepshard.runtime.parallel.schedule import bubble_fraction

            theory = f"{bubble_fraction(s.pipe, s.accumulation):.2f}"
        note = f"stage boundaries {first['parts']}" if first["parts"] else ""
        lines.append(f"| {s.name} | {shape} | {step:.3f} | {ratio} | {min(first['step_s']):.3f}"
                     f" / {max(first['step_s']):.3f} | {first['losses'][0]:.6f} | "
                     f"{first['losses'][-1]:.6f} | "
                     f"{_fmt(stage_bubbles(o)) if s.pipe > 1 else '-'} | {theory} | {note} |")
    return lines


def _vs_theory(values: list[float] | None, theory: float) -> str:
    """``0.118 / 0.115 (+6% / +4%)``: per stage, and off the theory relative to it."""
    if not values:
        return "-"
    return (" / ".join(f"{v:.3f}" for v in values) + " ("
            + " / ".join(f"{round((v - theory) / theory, 2) + 0.0:+.0%}" for v in values)
            + ")")


def bubble_table(outcomes: list[Outcome]) -> list[str]:
    from deepshard.runtime.parallel.schedule import bubble_fraction

    lines = ["| P | m | ranks | s/step | fwd+bwd ms per micro-batch, per stage (max/min) | "
             "1 - busy/total, per stage (vs theory) | 1 - busy/pipeline span (vs theory) | "
             "1 - busy/own pipe_s | theory (P-1)/(m+P-1) | simulated with measured stage "
             "costs |", "|---:|---:|---:|---:|---|---|---|---|---:|---|"]
    for o in outcomes:
        s = o.spec
        head = f"| {s.pipe} | {s.accumulation} | {s.world} |"
        theory = bubble_fraction(s.pipe, s.accumulation)
        if not o.ranks:
            why = o.why_not.replace("|", "\\|")
            lines.append(f"{head} - | {why} | - | - | - | {theory:.3f} | - |")
            continue
        costs = stage_costs(o)
        simulated = simulated_bubbles(costs, s.accumulation) if costs else None
        per_mb = "-"
        if costs:
            busy = [f + b for f, b in costs]
            per_mb = (", ".join(f"{f * 1e3:.0f}+{b * 1e3:.0f}" for f, b in costs)
                      + f" ({max(busy) / min(busy):.3f})")
        lines.append(f"{head} {median_step(o):.3f} | {per_mb} | "
                     f"{_vs_theory(stage_bubbles(o), theory)} | "
                     f"{_vs_theory(stage_bubbles(o, 'span'), theory)} | "
                     f"{_fmt(stage_bubbles(o, 'pipe_s'))} | {theory:.3f} | "
                     f"{_fmt(simulated, 3)} |")
    return lines


def layout_rows(outcomes: list[Outcome]) -> list[dict]:
    """The layout table's numbers, unformatted, for ``benchmarks/results/parallel.json``."""
    from deepshard.runtime.parallel.schedule import bubble_fraction

    ran = {o.spec.name: o for o in outcomes if o.ranks}
    baseline = median_step(ran["dp4"]) if "dp4" in ran else None
    rows = []
    for o in outcomes:
        s = o.spec
        row = {"kind": "layout", "layout": s.name, "pipe": s.pipe, "data": s.data,
               "tensor": s.tensor, "micro": s.micro, "m": s.accumulation,
               "status": o.why_not or "ok",
               "theory": bubble_fraction(s.pipe, s.accumulation) if s.pipe > 1 else None}
        if o.ranks:
            first = o.ranks[0]
            row.update(median_s=median_step(o), step_s=first["step_s"],
                       vs_dp4=median_step(o) / baseline if baseline else None,
                       loss_first=first["losses"][0], loss_last=first["losses"][-1],
                       bubble_total=stage_bubbles(o) if s.pipe > 1 else None,
                       parts=first["parts"])
        rows.append(row)
    return rows


def bubble_rows(outcomes: list[Outcome]) -> list[dict]:
    """The bubble sweep's numbers per m, unformatted: each stage's forward and backward
    seconds per micro-batch, its measured bubble over the batch, the span and its own
    ``pipe_s``, the theory and the simulator's bubble per stage."""
    from deepshard.runtime.parallel.schedule import bubble_fraction

    rows = []
    for o in outcomes:
        s = o.spec
        row = {"kind": "bubble", "pipe": s.pipe, "m": s.accumulation, "ranks": s.world,
               "micro": s.micro, "theory": bubble_fraction(s.pipe, s.accumulation),
               "status": o.why_not or "ok"}
        if o.ranks:
            costs = stage_costs(o)
            row.update(median_s=median_step(o), step_s=o.ranks[0]["step_s"],
                       stage_cost_s=[list(c) for c in costs] if costs else None,
                       bubble_total=stage_bubbles(o), bubble_span=stage_bubbles(o, "span"),
                       bubble_own=stage_bubbles(o, "pipe_s"),
                       simulated=simulated_bubbles(costs, s.accumulation) if costs else None,
                       parts=o.ranks[0]["parts"])
        rows.append(row)
    return rows


def _parts(outcomes: list[Outcome]) -> str:
    """The layer boundaries the sweep's pipelines got (one line per distinct split)."""
    seen = {str(o.ranks[0]["parts"]) for o in outcomes if o.ranks and o.ranks[0]["parts"]}
    return ", ".join(sorted(seen)) or "-"


def loss_check(outcomes: list[Outcome]) -> str:
    """Do all layouts agree on step 1's loss (same weights, same global batch)?"""
    firsts = {o.spec.name: o.ranks[0]["losses"][0] for o in outcomes if o.ranks}
    if len(firsts) < 2:
        return "step-1 losses: fewer than 2 layouts ran, nothing to compare"
    spread = max(firsts.values()) - min(firsts.values())
    return f"step-1 losses of the {len(firsts)} layouts that ran: spread {spread:.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated subset of {', '.join(LAYOUTS)} ('' for none)")
    parser.add_argument("--global-batch", type=int, default=16, help="samples per step")
    parser.add_argument("--micro", type=int, default=2, help="samples per micro-batch")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--bubble-stages", default="2",
                        help="pipelines of P ranks alone (P x 1 x 1) for the bubble sweep; "
                             "comma-separated, '' for none")
    parser.add_argument("--bubble-m", default="1,2,4,8", help="micro-batches per step")
    parser.add_argument("--bubble-size", choices=sorted(SIZES), default="balanced",
                        help="the bubble sweep's model: 'balanced' (2 equal stages, split "
                             "'uniform') or any --size (split by --partition-method)")
    parser.add_argument("--partition-method", default="type:Block",
                        help="the PipelineModule's partition_method ('parameters' gives the "
                             "embedding a stage of its own at P = 4: its parameters are many, "
                             "its compute nil)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write every rank's raw result here")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder for the run's record, parallel.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(RunSpec(**json.loads(args.worker)))
        return
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout {unknown[0]!r}; choose from {', '.join(LAYOUTS)}")
    layouts = [layout_spec(n, args) for n in names]
    sweep_partition = "uniform" if args.bubble_size == "balanced" else args.partition_method
    sweep = [RunSpec(f"pp{p}-m{m}", p, p, 1, args.micro, m, args.bubble_size, args.steps,
                     args.warmup, sweep_partition)
             for p in map(int, filter(None, args.bubble_stages.split(",")))
             for m in map(int, filter(None, args.bubble_m.split(",")))]
    missing = deepshard_missing()
    record = Run("parallel", {key: getattr(args, key) for key in (
        "size", "layouts", "global_batch", "micro", "steps", "warmup", "bubble_stages",
        "bubble_m", "bubble_size", "partition_method")} | {"sweep_partition": sweep_partition})
    outcomes = []
    for spec in layouts + sweep:
        if missing:
            outcomes.append(Outcome(spec, why_not=f"skipped: {missing}"))
            continue
        print(f"running {spec.name} ({spec.world} ranks) ...", file=sys.stderr, flush=True)
        outcome = run(spec, args.timeout)
        if outcome.why_not:
            print(f"{spec.name} {outcome.why_not}", file=sys.stderr, flush=True)
        outcomes.append(outcome)
    tables = print_report(args, outcomes[:len(layouts)], outcomes[len(layouts):])
    record.write(layout_rows(outcomes[:len(layouts)]) + bubble_rows(outcomes[len(layouts):]),
                 tables, args.results)


def print_report(args: argparse.Namespace, layouts: list[Outcome],
                 sweep: list[Outcome]) -> list[str]:
    """Print the run's header and tables; the tables' lines (both, a blank line between)."""
    import torch

    size = SIZES[args.size]
    params = next((o.ranks[0]["params"] for o in layouts + sweep if o.ranks and
                   o.spec.pipe == 1 and o.spec.tensor == 1), None)
    print(f"GPT {args.size} ({size or 'GPTConfig()'}"
          + (f", {params / 1e6:.1f}M parameters" if params else "") + f"), fp32, CPU ranks "
          f"with 1 thread each (gloo), global batch {args.global_batch}, micro-batch "
          f"{args.micro}, seq 128, AdamW, no clipping, pipeline partition_method "
          f"{args.partition_method!r}; median of {args.steps} steps after "
          f"{args.warmup} warm-up, barrier before and after each step; rank 0's times")
    print(f"{platform.node()}, {os.cpu_count()} cores ({cpu_model()}), "
          f"Python {platform.python_version()}, torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    tables: list[str] = []
    if layouts:
        tables += layout_table(layouts)
        print()
        print("\n".join(layout_table(layouts)))
        print(loss_check(layouts))
    if sweep:
        print()
        partition = sweep[0].spec.partition
        print(f"Pipeline bubble, P ranks alone (P x 1 x 1): GPT {args.bubble_size} "
              f"({SIZES[args.bubble_size] or 'GPTConfig()'}), partition_method "
              f"{partition!r}; the stage boundaries {_parts(sweep)}:")
        tables += ([""] if tables else []) + bubble_table(sweep)
        print("\n".join(bubble_table(sweep)))
    if args.json:
        args.json.write_text(json.dumps(
            [{"spec": dataclasses.asdict(o.spec), "ranks": o.ranks, "why_not": o.why_not}
             for o in layouts + sweep], indent=1))
    return tables


if __name__ == "__main__":
    main()
