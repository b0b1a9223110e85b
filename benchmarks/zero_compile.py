"""The ``--compile`` report of ``benchmarks/zero.py``: compiled training beside eager at each
ZeRO stage, deepshard's ``engine.compile()`` beside DeepSpeed's, and the issue's targets.

zero.py runs the peers (``COMPILE_PEERS``; its docstring says how each is built and warmed
up, and how the compile time is taken); this module only turns their outcomes into the
table, the record's rows and the target verdicts, torch-free like the rest of the parent.

Columns, rank 0's numbers unless said otherwise:

* s/step: the median step time after the warm-up, over all rounds;
* compile s: the first step's wall time, the median over rounds (each round compiles anew);
  an eager peer's first step is there to compare with;
* x eager: how many times faster a compiled peer steps than the same runtime eager
  (``deepshard-zN`` for ``deepshard-zN-compiled``, ``ddp-fused`` for ``ddp-compiled``):
  eager s/step over compiled s/step;
* x DeepSpeed: how many times faster a deepshard peer steps than its DeepSpeed twin (the
  same stage, both compiled or both eager): DeepSpeed s/step over deepshard s/step;
* peak RSS of each rank, and the last step's loss; the notes give the warm-up steps' times
  and, for a compiled peer, the forward graphs Dynamo compiled and its graph breaks.

Targets (issue "Compiled training: engine.compile() at every ZeRO stage"), printed each
with ``met``, ``MISSED`` or ``not measured``, for the stages that ran:

* deepshard compiled at least ``SPEEDUP_VS_EAGER`` (1.25x) faster than deepshard eager at
  every stage;
* deepshard compiled at least ``SPEEDUP_VS_DEEPSPEED`` (1.2x) faster than DeepSpeed's
  compiled engine at stages 2 and 3;
* deepshard compiled peak RSS (the higher rank's) at most eager's at every stage.
"""

from __future__ import annotations

import statistics
from typing import Any

SPEEDUP_VS_EAGER = 1.25
SPEEDUP_VS_DEEPSPEED = 1.2
DEEPSPEED_TARGET_STAGES = (2, 3)
"""The stages at which deepshard compiled is held to ``SPEEDUP_VS_DEEPSPEED``."""


def eager_of(peer: Any) -> str | None:
    """The name of the eager peer a compiled one is compared with; None for an eager one."""
    if not peer.compiled:
        return None
    return "ddp-fused" if peer.runtime == "ddp" else peer.name.removesuffix("-compiled")


def speedups(outcomes: list) -> dict[str, tuple[float | None, float | None]]:
    """Per peer that ran: (x eager, x DeepSpeed), None where the other peer did not run
    or there is none."""
    ran = {o.peer.name: o for o in outcomes if o.ranks}
    out = {}
    for name, o in ran.items():
        eager, twin = ran.get(eager_of(o.peer) or ""), ran.get(o.peer.twin or "")
        out[name] = (eager.median_s / o.median_s if eager else None,
                     twin.median_s / o.median_s if twin else None)
    return out


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def table(outcomes: list, first_steps: dict[str, list[float]]) -> list[str]:
    """The markdown table; ``first_steps``: each round's first step time per peer."""
    ratios = speedups(outcomes)
    lines = ["| peer | s/step (median) | compile s (1st step) | x eager | x DeepSpeed "
             "| peak RSS rank0 / rank1 (MiB) | last loss | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for o in outcomes:
        if not o.ranks:
            why = o.why_not.replace("|", "\\|")
            lines.append(f"| {o.peer.name} | - | - | - | - | - | - | {why} |")
            continue
        first = o.ranks[0]
        vs_eager, vs_ds = ratios[o.peer.name]
        rss = " / ".join(f"{r['peak_rss_kib'] / 1024:.0f}" for r in o.ranks)
        warmup = ", ".join(f"{t:.2f}" for t in first["warmup_s"])
        graphs = (f"; {first['dynamo_graphs']} graphs, {first['graph_breaks']} graph breaks"
                  if "dynamo_graphs" in first else "")
        note = (f"{o.peer.note}; optimizer {first['optimizer']}; min {min(first['step_s']):.3f} "
                f"max {max(first['step_s']):.3f} s; last round's warm-up {warmup} s{graphs}")
        lines.append(f"| {o.peer.name} | {o.median_s:.3f} | "
                     f"{statistics.median(first_steps[o.peer.name]):.1f} | {_x(vs_eager)} | "
                     f"{_x(vs_ds)} | {rss} | {first['losses'][-1]:.4f} | {note} |")
    return lines


def rows(outcomes: list, first_steps: dict[str, list[float]]) -> list[dict]:
    """The table's numbers per peer, unformatted, for ``benchmarks/results/zero_compile.json``."""
    ratios = speedups(outcomes)
    out = []
    for o in outcomes:
        p = o.peer
        row = {"peer": p.name, "runtime": p.runtime, "stage": p.stage, "compiled": p.compiled,
               "fused": p.fused, "note": p.note, "eager": eager_of(p), "twin": p.twin,
               "status": o.why_not or "ok"}
        if o.ranks:
            first = o.ranks[0]
            row.update(median_s=o.median_s, min_s=min(first["step_s"]),
                       max_s=max(first["step_s"]), step_s=first["step_s"],
                       first_step_s=first_steps[p.name],
                       compile_s=statistics.median(first_steps[p.name]),
                       warmup_s=first["warmup_s"], speedup_vs_eager=ratios[p.name][0],
                       speedup_vs_deepspeed=ratios[p.name][1],
                       peak_rss_mib=[r["peak_rss_kib"] / 1024 for r in o.ranks],
                       final_loss=first["losses"][-1], optimizer=first["optimizer"],
                       params=first["params"], dynamo_graphs=first.get("dynamo_graphs"),
                       graph_breaks=first.get("graph_breaks"))
        out.append(row)
    return out


def targets(outcomes: list) -> list[str]:
    """One line per target and stage that ran: the measured value, the target, the verdict."""
    ran = {o.peer.name: o for o in outcomes if o.ranks}
    stages = sorted({o.peer.stage for o in outcomes
                     if o.peer.runtime == "deepshard" and o.peer.compiled})
    lines = []
    for stage in stages:
        compiled = f"deepshard-z{stage}-compiled"
        pairs = [(f"deepshard-z{stage}", "deepshard eager", SPEEDUP_VS_EAGER)]
        if stage in DEEPSPEED_TARGET_STAGES:
            pairs.append((f"deepspeed-z{stage}-compiled", "DeepSpeed compiled",
                          SPEEDUP_VS_DEEPSPEED))
        for other, what, want in pairs:
            head = f"target stage {stage}: deepshard compiled >= {want}x faster than {what}"
            missing = [n for n in (compiled, other) if n not in ran]
            if missing:
                lines.append(f"{head}: not measured ({missing[0]} did not run)")
                continue
            speedup = ran[other].median_s / ran[compiled].median_s
            lines.append(f"{head}: {speedup:.2f}x, {'met' if speedup >= want else 'MISSED'}")
        head = f"target stage {stage}: deepshard compiled peak RSS <= deepshard eager's"
        missing = [n for n in (compiled, f"deepshard-z{stage}") if n not in ran]
        if missing:
            lines.append(f"{head}: not measured ({missing[0]} did not run)")
            continue
        ours, eager = (max(r["peak_rss_kib"] for r in ran[n].ranks) / 1024
                       for n in (compiled, f"deepshard-z{stage}"))
        lines.append(f"{head}: {ours:.0f} MiB vs {eager:.0f} MiB, "
                     f"{'met' if ours <= eager else 'MISSED'}")
    return lines
