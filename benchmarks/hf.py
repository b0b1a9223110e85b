"""HF fine-tuning: deepshard against transformers + DeepSpeed, on 2 CPU ranks.

One Llama built from a ``LlamaConfig`` (hidden 768, 12 layers, intermediate 2048, 12 heads,
vocab 32000, untied head: 134.1M parameters, 512 MiB in fp32; ``--quick``: hidden 384,
2 layers, 28.1M) is created once with seeded weights and saved with ``save_pretrained``
(safetensors) to a temporary directory; every row loads it from there (no downloads).
Each row runs as 2 fresh worker processes (``benchmarks/hf_worker.py``, gloo, one thread
each, RANK/WORLD_SIZE/MASTER_* set directly, no launcher), one row after another; each
worker reports its own figures (``ru_maxrss`` for peaks). Measurements:

1. fine-tune (``train``), ZeRO stages 2 and 3, fp32 (bf16 is off: DeepSpeed's ZeRO takes
   fp32 on CPU), AdamW lr 1e-4 wd 0.01, clipping 1.0, constant schedule, micro-batch
   ``--micro-batch`` per rank, sequence 128, seeded random tokens, an all-"auto" HF config:
   DeepSpeed through transformers' ``Trainer`` + ``TrainingArguments(deepspeed=cfg)``,
   deepshard through ``deepshard.integrations.transformers.Trainer``/``TrainingArguments``
   (the same arguments), and ``--driver compat``: DeepSpeed's worker code exactly
   (transformers' own ``Trainer``/``TrainingArguments``) in deepshard's interpreter with
   ``deepshard.contract.SHIM_DIR`` first on ``PYTHONPATH``, as ``ds-run --deepspeed_compat``
   sets it, so that ``import deepspeed`` (transformers' and accelerate's too) is deepshard.
   The model is built after the arguments (at ZeRO-3 it loads partitioned through them).
   Step time: rank 0's median of the optimizer steps after ``--warmup``, from a
   ``TrainerCallback`` (``on_step_begin`` to ``on_step_end``). Time to the first step: per
   rank, from the worker process's creation (its kernel start time) to the end of its first
   optimizer step (``on_step_end``): interpreter, imports, process group, loading, engine
   and the step itself. A side-by-side table puts the Trainer rows (DeepSpeed, compat,
   deepshard's Trainer) under each other; the per-driver tables also give rank 0's
   collective traffic per timed step (all-gather output bytes; reduce-scatter plus
   all-reduce bytes), counted around torch.distributed's calls:
   at ZeRO-3 both keep a model this small gathered from forward into backward under the
   default ``stage3_max_reuse_distance``/``max_live_parameters`` (1e9), one gather of the
   model per step (with the distance at 0, every unit is gathered again in backward).
   ``--driver initialize`` (``both``: with the Trainer; ``all``: with the Trainer and
   compat) adds rows driven by ``initialize`` on the same HF model (a filled config, a
   barrier before and after each step); ``auto`` (default: trainer and compat) adds them
   only when deepshard's Trainer cannot be imported.
2. loading partitioned at ZeRO-3 (``load``): a ``HfDeepSpeedConfig(cfg)`` /
   ``HfDeepShardConfig(cfg)`` alive, then ``AutoModelForCausalLM.from_pretrained(dir)``;
   baseline = ``ru_maxrss`` after the imports, the process group and the config object;
   the table gives the baseline, the peak after loading and their difference (the load's
   own peak), per rank.
3. LoRA on a partitioned base (``lora``): the base loaded as in 2, peft LoRA r=8 on
   q_proj/v_proj, ``initialize`` at ZeRO-3 with only the LoRA parameters trainable, a
   few steps; per-rank parameter bytes: deepshard's ``engine.state_bytes()["params"]``,
   DeepSpeed's partitions (``ds_tensor`` bytes, or the whole ``data`` of a parameter it
   keeps whole), against the base model's bytes.

Targets (printed with each table): step time no slower than DeepSpeed (ratio <= 1),
training peak RSS below DeepSpeed's (< 1; through the compat path <= 0.8), loading peak
<= 0.6x DeepSpeed's, LoRA per-rank parameter bytes ~ 1/N of the base (here <= 1.1/N).

    make bench-hf                                   # = python benchmarks/hf.py
    python benchmarks/hf.py [--quick] [--parts train,load,lora] [--stages 2,3]
                            [--driver auto|trainer|compat|initialize|both|all]
                            [--steps 3] [--warmup 1]
                            [--rounds 1] [--micro-batch 1] [--output FILE] [--json FILE]

The DeepSpeed rows run with ``--deepspeed-python`` (default /tmp/dsvenv/bin/python: DeepSpeed
0.19.8, transformers, accelerate; peft for its LoRA row) with ``DS_ACCELERATOR=cpu`` and are
skipped, with the reason, where it cannot import deepspeed. A deepshard row whose piece is
missing or fails says ``failed: <the error line>``; the other rows still run. On CPU
transformers' Trainer starts torch.distributed through Accelerate but not
``deepspeed.comm``, so the DeepSpeed worker calls ``deepspeed.init_distributed()`` after
``TrainingArguments`` (without it ``zero.Init`` counts one rank and fails its batch-size
assertion at ZeRO-3; at ZeRO-2 ``deepspeed.initialize`` starts it itself). The compat worker
needs no such call at either stage: deepshard's ``comm`` uses the process group Accelerate
started.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "hf_worker.py"
sys.path.insert(0, str(HERE))

from record import RESULTS, Run  # noqa: E402
from train import (  # noqa: E402
    DEFAULT_DS_PYTHON,
    RESULT_TAG,
    WORLD,
    cpu_model,
    deepspeed_version,
    error_line,
    wait_all,
)

LORA_TOLERANCE = 1.1
"""LoRA per-rank parameter bytes count as ~1/N of the base up to this factor."""
LOAD_TARGET = 0.6
TRAINER_TARGETS = {"compat": (1.0, 0.8, False), "trainer": (1.0, 1.0, True)}
"""Per deepshard driver against DeepSpeed's Trainer row: (s/step ratio <=, peak RSS ratio of
the worst rank <= or, strict, <)."""


@dataclass(frozen=True)
class Row:
    """One measurement of one library: what the two workers are asked to do."""

    part: str
    """``train``, ``load`` or ``lora``."""
    lib: str
    """``deepshard`` or ``deepspeed``."""
    stage: int = 3
    driver: str = ""
    """``trainer``, ``compat`` (deepshard only: DeepSpeed's ``trainer`` row is its code path)
    or ``initialize`` (``train`` only)."""

    @property
    def name(self) -> str:
        tail = f"-{self.driver}" if self.driver else ""
        return f"{self.lib}-{self.part}-z{self.stage}{tail}"

    @property
    def foreign(self) -> bool:
        return self.lib == "deepspeed"

    @property
    def label(self) -> str:
        if self.driver == "compat":
            return "deepshard (compat)"
        what = {"trainer": "Trainer"}.get(self.driver, self.driver or self.part)
        return f"{'DeepSpeed' if self.foreign else 'deepshard'} {what}"

    @property
    def baseline(self) -> Row:
        """DeepSpeed's row this one is compared with (compat: transformers' Trainer)."""
        driver = "trainer" if self.driver == "compat" else self.driver
        return Row(self.part, "deepspeed", self.stage, driver)


@dataclass
class Outcome:
    row: Row
    ranks: list[dict] = field(default_factory=list)
    why_not: str = ""


# ---------------------------------------------------------------- running the workers

def run_row(row: Row, args: argparse.Namespace, model_dir: str) -> Outcome:
    """Start the row's two ranks, wait, and collect their result lines; a failure is an
    outcome (``why_not``), never an exception."""
    from deepshard.contract import SHIM_DIR, prepend_to_path
    from deepshard.launcher.cli import free_port

    python = args.deepspeed_python if row.foreign else sys.executable
    port = free_port("127.0.0.1")
    env = {**os.environ, "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if row.foreign:
        env["DS_ACCELERATOR"] = "cpu"
    if row.driver == "compat":  # what ds-run --deepspeed_compat gives its workers
        env["PYTHONPATH"] = prepend_to_path(SHIM_DIR, os.environ.get("PYTHONPATH"))
    argv = [python, str(WORKER), row.part, row.lib, "--model", model_dir,
            "--stage", str(row.stage), "--driver", row.driver or "trainer",
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--micro-batch", str(args.micro_batch)]
    print(f"running {row.name} ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix=f"bench-{row.name}-") as tmp:
        procs = []
        for rank in range(WORLD):
            stem = Path(tmp) / str(rank)
            with open(f"{stem}.out", "w") as out, open(f"{stem}.err", "w") as err:
                procs.append(subprocess.Popen(
                    argv, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=ROOT,
                    stdout=out, stderr=err, stdin=subprocess.DEVNULL))
        codes = wait_all(procs, args.timeout)
        if None in codes and all(code in (None, 0) for code in codes):
            return Outcome(row, why_not=f"failed: timed out after {args.timeout:.0f} s")
        failed = sorted((code == -signal.SIGKILL, rank) for rank, code in enumerate(codes)
                        if code != 0)
        if failed:
            rank = failed[0][1]
            line = error_line(Path(tmp) / f"{rank}.err")
            return Outcome(row, why_not=f"failed: {line} (rank {rank}, exit {codes[rank]})")
        ranks = []
        for rank in range(WORLD):
            out = (Path(tmp) / f"{rank}.out").read_text(errors="replace").splitlines()
            lines = [line for line in out if line.startswith(RESULT_TAG)]
            if not lines:
                return Outcome(row, why_not=f"failed: rank {rank} exited without a result")
            ranks.append(json.loads(lines[-1][len(RESULT_TAG):]))
    return Outcome(row, ranks)


def merge(outcomes: list[Outcome]) -> Outcome:
    """One row's rounds: all timed steps, the highest peaks and the median time to the first
    step per rank."""
    ran = [o for o in outcomes if o.ranks]
    if not ran:
        return outcomes[0]
    ranks = []
    for rank in range(WORLD):
        results = [o.ranks[rank] for o in ran]
        merged = dict(results[-1])
        if "step_s" in merged:
            merged["step_s"] = [t for r in results for t in r["step_s"]]
        if merged.get("first_step_s"):
            merged["first_step_s"] = statistics.median(r["first_step_s"] for r in results)
        for key in ("peak_rss_kib", "peak_kib", "load_peak_kib"):
            if key in merged:
                merged[key] = max(r[key] for r in results)
        ranks.append(merged)
    return Outcome(ran[0].row, ranks)


def make_model(directory: str, quick: bool) -> dict:
    argv = [sys.executable, str(WORKER), "make-model", directory] + (["--quick"] if quick else [])
    done = subprocess.run(argv, capture_output=True, text=True, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"building the model failed: {done.stderr[-800:]}")
    return json.loads(lines[-1][len(RESULT_TAG):])


def deepshard_trainer_missing() -> str:
    """Why deepshard's HF Trainer cannot be imported here, or ""."""
    probe = subprocess.run(
        [sys.executable, "-c", "try:\n from deepshard.integrations.transformers import Trainer"
         "\nexcept ImportError:\n from deepshard.integrations.hf_trainer import Trainer"],
        capture_output=True, text=True, check=False)
    return "" if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]


def shim_missing() -> str:
    """Why ``import deepspeed`` cannot resolve to deepshard through the shim, or ""."""
    from deepshard.contract import SHIM_DIR

    found = os.path.isfile(os.path.join(SHIM_DIR, "deepspeed", "__init__.py"))
    return "" if found else f"no deepspeed/__init__.py in the compat shim {SHIM_DIR}"


def deepspeed_has_peft(python: str) -> str:
    probe = subprocess.run([python, "-c", "import peft"], capture_output=True, text=True,
                           check=False, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return "" if probe.returncode == 0 else f"{python} cannot import peft"


# ---------------------------------------------------------------- tables

def mib(kib: float) -> str:
    return f"{kib / 1024:.0f}"


def verdict(ratio: float | None, target: float, strict: bool = False) -> str:
    if ratio is None:
        return "-"
    ok = ratio < target if strict else ratio <= target
    if ok:
        return "met"
    return f"MISSED by {(ratio / target - 1) * 100:.0f}%"


def why(o: Outcome) -> str:
    return o.why_not.replace("|", "\\|")


def comm_cell(o: Outcome) -> str:
    """Rank 0's all-gather output and reduce-scatter + all-reduce bytes per timed step."""
    comm = o.ranks[0].get("comm_per_step") if o.ranks else None
    if not comm:
        return "-"
    reduced = comm["reduce_scatter_tensor"] + comm["all_reduce"]
    return f"{comm['all_gather_into_tensor'] / 2**20:.0f}, {reduced / 2**20:.0f}"


def train_summary(o: Outcome | None) -> dict | None:
    """A train row's figures, unformatted: rank 0's step times, every rank's peak RSS and
    time to the first step, rank 0's final loss; None for a row that did not run."""
    if o is None or not o.ranks or "step_s" not in o.ranks[0]:
        return None
    times = o.ranks[0]["step_s"]
    losses = o.ranks[0]["losses"]
    return {"step_s": statistics.median(times), "step_min_s": min(times),
            "step_max_s": max(times), "peak_rss_mib": [r["peak_rss_kib"] / 1024 for r in o.ranks],
            "first_step_s": [r.get("first_step_s") for r in o.ranks],
            "final_loss": losses[-1] if losses else None}


def versus(ours: dict | None, theirs: dict | None) -> dict | None:
    """Ratios of two :func:`train_summary` figures: median s/step, peak RSS of the worst rank,
    time to the first step of the slower rank."""
    if ours is None or theirs is None:
        return None
    firsts = [max(s["first_step_s"]) if all(s["first_step_s"]) else None
              for s in (ours, theirs)]
    return {"step": ours["step_s"] / theirs["step_s"],
            "peak_rss": max(a / b for a, b in zip(ours["peak_rss_mib"], theirs["peak_rss_mib"],
                                                  strict=True)),
            "first_step": firsts[0] / firsts[1] if firsts[0] and firsts[1] else None}


def trainer_table(outcomes: dict[str, Outcome], stages: list[int],
                  drivers: list[str]) -> list[str]:
    """One line per stage and HF Trainer row: DeepSpeed's (transformers' Trainer), the same
    code on deepshard through the compat shim, deepshard's own Trainer; ratios against
    DeepSpeed's line."""
    shown = [d for d in ("compat", "trainer") if d in drivers]
    if not shown:
        return []
    goals = "; ".join(f"{Row('train', 'deepshard', 0, d).label}: s/step <= {step:.1f}, peak "
                      f"RSS {'<' if strict else '<='} {rss:.1f}"
                      for d, (step, rss, strict) in TRAINER_TARGETS.items() if d in shown)
    lines = ["**HF Trainer side by side** (s/step: rank 0's median; peak RSS: ru_maxrss per "
             "rank; first step: from the worker process's creation to the end of its first "
             "optimizer step, imports and model loading included; x = / DeepSpeed's line: "
             "worst rank for RSS, slower rank for the first step)", "",
             f"Targets vs DeepSpeed: {goals}; time to the first step: no target.", "",
             "| stage | row | s/step | min-max | x DS | target | peak RSS rank0 / rank1 MiB "
             "| x DS | target | first step s rank0 / rank1 | x DS | final loss |",
             "|---|---|---:|---|---:|---|---:|---:|---|---:|---:|---:|"]
    notes: list[str] = []
    for stage in stages:
        base = Row("train", "deepspeed", stage, "trainer")
        theirs = train_summary(outcomes.get(base.name))
        for row in [base] + [Row("train", "deepshard", stage, d) for d in shown]:
            o = outcomes.get(row.name)
            if o is None:
                continue
            label = (f"DeepSpeed {o.ranks[0].get('version', '')}".strip() if row.foreign
                     else row.label)
            fig = train_summary(o)
            if fig is None:
                lines.append(f"| {stage} | {label} | {why(o)} |" + " - |" * 9)
                continue
            if row.driver not in drivers or row.driver == "compat":
                notes.append(f"- {row.name}: " + "; ".join(o.ranks[0].get("notes", []))
                             + f"; optimizer {o.ranks[0]['optimizer']}")
            ratio = None if row.foreign else versus(fig, theirs)
            step_goal, rss_goal, strict = TRAINER_TARGETS.get(row.driver, (1.0, 1.0, True))
            x = ({k: f"{v:.2f}" if v is not None else "-" for k, v in ratio.items()} if ratio
                 else dict.fromkeys(("step", "peak_rss", "first_step"),
                                    "-" if not row.foreign else "1.00"))
            rss = " / ".join(f"{m:.0f}" for m in fig["peak_rss_mib"])
            first = " / ".join(f"{t:.1f}" if t else "-" for t in fig["first_step_s"])
            loss = f"{fig['final_loss']:.4f}" if fig["final_loss"] is not None else "-"
            lines.append(
                f"| {stage} | {label} | {fig['step_s']:.3f} | {fig['step_min_s']:.2f}-"
                f"{fig['step_max_s']:.2f} | {x['step']} | "
                f"{verdict(ratio['step'], step_goal) if ratio else '-'} | {rss} | "
                f"{x['peak_rss']} | "
                f"{verdict(ratio['peak_rss'], rss_goal, strict) if ratio else '-'} | {first} | "
                f"{x['first_step']} | {loss} |")
    return lines + (["", *notes] if notes else [])


def train_tables(outcomes: dict[str, Outcome], stages: list[int],
                 drivers: list[str]) -> list[str]:
    steps = ["**Step time** (rank 0's median s/optimizer step; target: deepshard/DeepSpeed "
             "<= 1; the fastest steps' ratio is less sensitive to other load on the machine)",
             "",
             "| stage | driver | deepshard s/step | DeepSpeed s/step | ratio | target <= 1 "
             "| ratio of the fastest steps "
             "| deepshard min-max | DeepSpeed min-max | final loss deepshard / DeepSpeed "
             "| MiB/step gathered, reduced deepshard / DeepSpeed |",
             "|---|---|---:|---:|---:|---|---:|---|---|---|---|"]
    peaks = ["**Training peak RSS** per rank (MiB, ru_maxrss of the whole run: model load, "
             "engine, steps; target: deepshard/DeepSpeed < 1 on every rank)", "",
             "| stage | driver | deepshard rank0 / rank1 | DeepSpeed rank0 / rank1 "
             "| ratio (worst rank) | target < 1 | loaded param bytes/rank deepshard / "
             "DeepSpeed (MiB) |",
             "|---|---|---:|---:|---:|---|---|"]
    notes: list[str] = []
    for stage in stages:
        for driver in drivers:
            ours = outcomes.get(Row("train", "deepshard", stage, driver).name)
            theirs = outcomes.get(Row("train", "deepspeed", stage, driver).name)
            if ours is None or theirs is None:
                continue
            cells = []
            for o in (ours, theirs):
                if o.ranks:
                    times = o.ranks[0]["step_s"]
                    cells.append((statistics.median(times),
                                  f"{min(times):.2f}-{max(times):.2f}",
                                  o.ranks[0]["losses"][-1] if o.ranks[0]["losses"] else None))
                else:
                    cells.append(None)
            ratio = cells[0][0] / cells[1][0] if cells[0] and cells[1] else None
            losses = " / ".join(f"{c[2]:.4f}" if c and c[2] is not None else "-"
                                for c in cells)
            medians = [f"{c[0]:.3f}" if c else "-" for c in cells]
            fastest = (f"{min(ours.ranks[0]['step_s']) / min(theirs.ranks[0]['step_s']):.2f}"
                       if ratio is not None else "-")
            spreads = [c[1] if c else why(o) for c, o in zip(cells, (ours, theirs),
                                                             strict=True)]
            steps.append(f"| {stage} | {driver} | {medians[0]} | {medians[1]} | "
                         + (f"{ratio:.2f}" if ratio is not None else "-")
                         + f" | {verdict(ratio, 1.0)} | {fastest} | {spreads[0]} | "
                         f"{spreads[1]} | "
                         f"{losses} | {comm_cell(ours)} / {comm_cell(theirs)} |")
            rss = [" / ".join(mib(r["peak_rss_kib"]) for r in o.ranks) if o.ranks else why(o)
                   for o in (ours, theirs)]
            worst = (max(a["peak_rss_kib"] / b["peak_rss_kib"]
                         for a, b in zip(ours.ranks, theirs.ranks, strict=True))
                     if ours.ranks and theirs.ranks else None)
            held = " / ".join(f"{o.ranks[0]['loaded_params']['held'] / 2**20:.0f}"
                              if o.ranks else "-" for o in (ours, theirs))
            peaks.append(f"| {stage} | {driver} | {rss[0]} | {rss[1]} | "
                         + (f"{worst:.2f}" if worst is not None else "-")
                         + f" | {verdict(worst, 1.0, strict=True)} | {held} |")
            for o in (ours, theirs):
                if o.ranks and o.ranks[0].get("notes"):
                    notes.append(f"- {o.row.name}: " + "; ".join(o.ranks[0]["notes"])
                                 + f"; optimizer {o.ranks[0]['optimizer']}")
    return steps + [""] + peaks + (["", *notes] if notes else [])


def load_table(ours: Outcome | None, theirs: Outcome | None) -> list[str]:
    lines = ["**Loading peak RSS** at ZeRO-3 (MiB per rank: baseline after imports + "
             "process group + config object, peak after from_pretrained, and the load's own "
             f"peak = their difference; target: deepshard/DeepSpeed <= {LOAD_TARGET})", "",
             "| rank | deepshard baseline / peak / load | DeepSpeed baseline / peak / load "
             f"| ratio load | target <= {LOAD_TARGET} | ratio peak | target <= {LOAD_TARGET} "
             "| RSS after load deepshard / DeepSpeed | param bytes held deepshard / "
             "DeepSpeed (MiB) | load s deepshard / DeepSpeed |",
             "|---|---:|---:|---:|---|---:|---|---|---|---|"]
    if ours is None or theirs is None:
        return []
    for rank in range(WORLD):
        cells, figures = [], []
        for o in (ours, theirs):
            if not o.ranks:
                cells.append(why(o))
                figures.append(None)
                continue
            r = o.ranks[rank]
            delta = r["peak_kib"] - r["before_peak_kib"]
            cells.append(f"{mib(r['before_peak_kib'])} / {mib(r['peak_kib'])} / {mib(delta)}")
            figures.append((delta, r["peak_kib"], r["after_now_kib"], r["params"]["held"],
                            r["load_s"]))
        a, b = figures
        load = a[0] / b[0] if a and b else None
        peak = a[1] / b[1] if a and b else None
        now = " / ".join(mib(f[2]) if f else "-" for f in figures)
        held = " / ".join(f"{f[3] / 2**20:.0f}" if f else "-" for f in figures)
        secs = " / ".join(f"{f[4]:.1f}" if f else "-" for f in figures)
        lines.append(f"| {rank} | {cells[0]} | {cells[1]} | "
                     + (f"{load:.2f}" if load is not None else "-")
                     + f" | {verdict(load, LOAD_TARGET)} | "
                     + (f"{peak:.2f}" if peak is not None else "-")
                     + f" | {verdict(peak, LOAD_TARGET)} | {now} | {held} | {secs} |")
    return lines


def lora_table(ours: Outcome | None, theirs: Outcome | None) -> list[str]:
    if ours is None and theirs is None:
        return []
    target = LORA_TOLERANCE / WORLD
    lines = [f"**LoRA on a ZeRO-3 base** (peft r=8 on q_proj/v_proj; per-rank parameter bytes "
             f"between steps / the base model's bytes; target ~1/N = {1 / WORLD:.2f}, "
             f"here <= {target:.2f})", "",
             "| library | base MiB | per-rank param MiB (source) | fraction of base "
             f"| target <= {target:.2f} | after load + peft MiB/rank | LoRA trainable MiB "
             "| peak RSS rank0 / rank1 MiB | s/step | MiB/step gathered, reduced "
             "| vs DeepSpeed |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---|"]
    theirs_bytes = theirs_step = None
    rows: list = []
    for o in (ours, theirs):
        if o is None:
            continue
        if not o.ranks:
            rows.append(f"| {o.row.lib} | - | {why(o)} | - | - | - | - | - | - | - | - |")
            continue
        r = o.ranks[0]
        if "state_bytes" in r:
            held, source = r["state_bytes"]["params"], "engine.state_bytes()"
        else:
            held, source = r["after_steps"]["held"], "ds_tensor / data"
        if o.row.lib == "deepspeed":
            theirs_bytes, theirs_step = held, statistics.median(r["step_s"])
        frac = held / r["base_bytes"]
        rss = " / ".join(mib(x["peak_rss_kib"]) for x in o.ranks)
        rows.append((o.row.lib, held, statistics.median(r["step_s"]),
                     f"| {o.row.lib} | {r['base_bytes'] / 2**20:.1f} | "
                     f"{held / 2**20:.1f} ({source}) | {frac:.3f} | {verdict(frac, target)} | "
                     f"{r['after_peft']['held'] / 2**20:.1f} | "
                     f"{r['trainable_bytes'] / 2**20:.2f} | {rss} | "
                     f"{statistics.median(r['step_s']):.3f} | {comm_cell(o)} |"))
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
            continue
        lib, held, step, text = row
        ratio = (f"params x{held / theirs_bytes:.2f}, s/step x{step / theirs_step:.2f}"
                 if lib == "deepshard" and theirs_bytes and theirs_step else "")
        lines.append(f"{text} {ratio} |")
    return lines


# ---------------------------------------------------------------- main

def git_commit() -> str:
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 28M Llama instead of 134M")
    parser.add_argument("--parts", default="train,load,lora",
                        help="comma-separated subset of train, load, lora")
    parser.add_argument("--stages", default="2,3", help="ZeRO stages for train")
    parser.add_argument("--driver", default="auto",
                        choices=["auto", "trainer", "compat", "initialize", "both", "all"],
                        help="train through deepshard's HF Trainer, transformers' Trainer on "
                             "the compat shim, initialize; both: trainer and initialize; all "
                             "three (auto: trainer and compat, and initialize too when "
                             "deepshard's Trainer is missing)")
    parser.add_argument("--libs", default="deepshard,deepspeed")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every row this many times (alternating the library order)")
    parser.add_argument("--micro-batch", type=int, default=1, help="per rank, sequence 128")
    parser.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per row")
    parser.add_argument("--output", type=Path, help="also write the report (markdown) here")
    parser.add_argument("--json", type=Path, help="also write every rank's raw result here")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder for the run's record, hf.json")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    libs = [lib.strip() for lib in args.libs.split(",") if lib.strip()]
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    record = Run("hf", {key: getattr(args, key) for key in (
        "quick", "parts", "stages", "driver", "libs", "steps", "warmup", "rounds",
        "micro_batch")} | {"world": WORLD})

    ds_label, ds_missing = deepspeed_version(args.deepspeed_python)
    trainer_missing = deepshard_trainer_missing()
    drivers = {"trainer": ["trainer"], "compat": ["compat"], "initialize": ["initialize"],
               "both": ["trainer", "initialize"], "all": ["trainer", "compat", "initialize"],
               "auto": ["trainer", "compat"] + (["initialize"] if trainer_missing else [])
               }[args.driver]
    rows: list[Row] = []
    for part in parts:
        if part == "train":  # compat's DeepSpeed row is the trainer's: run it once
            wanted = [Row("train", lib, stage, driver).baseline if lib == "deepspeed"
                      else Row("train", lib, stage, driver)
                      for stage in stages for driver in drivers for lib in libs]
            rows += list(dict.fromkeys(wanted))
        elif part in ("load", "lora"):
            rows += [Row(part, lib) for lib in libs]
        else:
            parser.error(f"unknown part {part!r}")

    def skipped(row: Row) -> str:
        if row.foreign and ds_missing:
            return f"skipped: {ds_missing}"
        if row.foreign and row.part == "lora":
            missing = deepspeed_has_peft(args.deepspeed_python)
            return f"skipped: {missing}" if missing else ""
        if row.lib == "deepshard" and row.driver == "trainer" and trainer_missing:
            return f"failed: deepshard's Trainer is not importable: {trainer_missing}"
        if row.driver == "compat" and shim_missing():
            return f"failed: {shim_missing()}"
        return ""

    with tempfile.TemporaryDirectory(prefix="hf-bench-model-") as model_dir:
        print(f"building the model in {model_dir} ...", file=sys.stderr, flush=True)
        model = make_model(model_dir, args.quick)
        runs: dict[str, list[Outcome]] = {row.name: [] for row in rows}
        for round_ in range(max(1, args.rounds)):
            order = rows if round_ % 2 == 0 else [r for pair in zip(rows[1::2], rows[::2],
                                                                      strict=False)
                                                  for r in pair] + rows[len(rows) // 2 * 2:]
            for row in order:
                reason = skipped(row)
                outcome = Outcome(row, why_not=reason) if reason else run_row(row, args,
                                                                              model_dir)
                if outcome.why_not:
                    print(f"{row.name}: {outcome.why_not}", file=sys.stderr, flush=True)
                runs[row.name].append(outcome)
        outcomes = {name: merge(o) for name, o in runs.items()}

    import torch

    finished = datetime.datetime.now(datetime.timezone.utc)
    size = "quick" if args.quick else "full"
    report = [
        f"# HF fine-tuning: deepshard vs transformers + DeepSpeed ({started:%Y-%m-%d %H:%M} - "
        f"{finished:%H:%M} UTC, commit {git_commit()})", "",
        f"Llama from LlamaConfig ({size}: hidden {model['hidden']}, vocab {model['vocab']}, "
        f"{model['params'] / 1e6:.1f}M parameters, {model['bytes'] / 2**20:.0f} MiB fp32), "
        f"{WORLD} gloo ranks on CPU, 1 thread each, fp32, AdamW lr 1e-4 wd 0.01, clip 1.0, "
        f"micro-batch {args.micro_batch}/rank, seq 128, gas 1; {args.rounds} round(s) x "
        f"{args.steps} timed steps after {args.warmup} warm-up.",
        f"{platform.node()}, {os.cpu_count()} cores ({cpu_model()}), Python "
        f"{platform.python_version()}, torch {torch.__version__}"
        + (f"; DeepSpeed side: {ds_label} ({args.deepspeed_python})" if ds_label else
           f"; DeepSpeed side: {ds_missing}")
        + f"; load average {load_before[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end "
          "(other processes on the machine inflate step times).", ""]
    if "train" in parts:
        report += [*trainer_table(outcomes, stages, drivers), ""]
        paired = [d for d in drivers if d != "compat"]  # compat's figures are all above
        report += [*train_tables(outcomes, stages, paired), ""] if paired else []
    if "load" in parts:
        report += [*load_table(outcomes.get(Row("load", "deepshard").name),
                                outcomes.get(Row("load", "deepspeed").name)), ""]
    if "lora" in parts:
        report += [*lora_table(outcomes.get(Row("lora", "deepshard").name),
                                outcomes.get(Row("lora", "deepspeed").name)), ""]
    text = "\n".join(report)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({row["row"]: row for row in record_rows(outcomes)},
                                        indent=1) + "\n")
    record.settings["model"] = model
    record.write(record_rows(outcomes), report, args.results)


def record_rows(outcomes: dict[str, Outcome]) -> list[dict]:
    """One row per measurement for ``benchmarks/results/hf.json`` (and ``--json``): what it
    was (part, library, stage, driver, label), its status, each rank's result line as the
    worker reported it (step times, RSS, losses, bytes; the tables are computed from these)
    and, for ``train``, the figures of the side-by-side table and their ratios against
    DeepSpeed's row (``vs_deepspeed``)."""
    rows = []
    for name, o in outcomes.items():
        row = {"row": name, "part": o.row.part, "lib": o.row.lib, "stage": o.row.stage,
               "driver": o.row.driver, "label": o.row.label, "status": o.why_not or "ok",
               "ranks": o.ranks}
        if o.row.part == "train":
            row["summary"] = train_summary(o)
            if not o.row.foreign:
                row["vs_deepspeed"] = versus(row["summary"],
                                             train_summary(outcomes.get(o.row.baseline.name)))
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
