"""Draw the README's benchmark plots from the runs' JSON records, and from nothing else.

Each benchmark writes ``benchmarks/results/<name>.json`` (``benchmarks/record.py``); this
script reads them and writes one PNG per benchmark (matplotlib, Agg backend, 800 px wide):

    zero.png     step time and peak RSS per rank by ZeRO stage beside DDP, FSDP2, DeepSpeed
    fanout.png   ds-run's ssh fan-out (flat, tree) beside pdsh and mpirun by host count
    bubble.png   the pipeline bubble measured beside the theory and the 1F1B simulator, by m
    launch.png   launch overhead of ds-run beside torchrun, DeepSpeed and plain python
    elastic.png  seconds from a node's death / return to steps again, ds-run beside torchrun
    moe.png      MoE GPT tokens/s, peak RSS and all-to-all bytes by ep, beside DeepSpeed
    long_seq.png longest sequence under a per-rank RSS budget by SP size, tiled and not,
                 and tokens/s beside DeepSpeed's Ulysses at those lengths
    data_efficiency.png
                 validation loss against wall time: baseline, curriculum, random-LTD, both
    zero_compile.png
                 step time, compile time and peak RSS by ZeRO stage: deepshard and
                 DeepSpeed, eager and engine.compile()'d, beside DDP eager and compiled
    inference.png
                 greedy generation tokens/s and peak RSS per rank (and its import
                 baseline), GPT-2 and LLaMA at batch 1 and 8: deepshard tp 1/2, fp32/int8,
                 beside HF generate and DeepSpeed
    zeropp.png   ZeRO-3, hpZ, qwZ+qgZ, all three and MiCS across two capped hosts: step
                 time by link speed and the bytes crossing hosts, beside DeepSpeed's

    python benchmarks/plot.py [--results benchmarks/results] [--out docs/plots]
                              [--only zero,fanout,...,inference,zeropp]

A missing or malformed record is one line naming the file, and exit status 2. Every
number drawn comes from a record; the footer gives the run's date, commit and load.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from record import RESULTS, RecordError, read  # noqa: E402

OUT = HERE.parent / "docs" / "plots"
WIDTH_IN, DPI = 8.0, 100
"""Figures are 800 px wide: the README's width."""
PLOTS = {"zero": "zero", "fanout": "fanout", "bubble": "parallel", "launch": "launch",
         "elastic": "elastic", "moe": "moe", "long_seq": "long_seq",
         "data_efficiency": "data_efficiency", "zero_compile": "zero_compile",
         "inference": "inference", "zeropp": "zeropp"}
"""Plot name -> the benchmark record it draws."""
SOURCES = {"zero_compile": "zero.py --compile"}
"""Record name -> the command that writes it, where that is not ``<name>.py``."""
COLORS = {"deepshard": "#1f77b4", "DeepSpeed": "#d62728", "torch, AdamW for-loop": "#7f7f7f",
          "torch, AdamW(fused=True)": "#bcbd22"}


class PlotError(Exception):
    """A record this script cannot draw; the message names the file."""


def footer(fig, data: dict) -> None:
    """The run's date, commit, machine and load, small, at the bottom left."""
    m = data["machine"]
    load = ""
    if m.get("loadavg_start"):
        load = f"; load average {m['loadavg_start'][0]:.2f} at start"
        if m.get("loadavg_end"):
            load += f", {m['loadavg_end'][0]:.2f} at end"
    source = SOURCES.get(data["benchmark"], f"{data['benchmark']}.py")
    fig.text(0.01, 0.008, f"benchmarks/{source}, run {data['date']}, commit "
             f"{data['commit']}; {m.get('cores', '?')} cores ({m.get('cpu', '?')}){load}",
             fontsize=7, color="#555555", ha="left", va="bottom")


def _figure(height_in: float, rows: int = 1, ratios: tuple[float, ...] | None = None):
    import matplotlib.pyplot as plt

    return plt.subplots(rows, 1, figsize=(WIDTH_IN, height_in), dpi=DPI,
                        gridspec_kw={"height_ratios": ratios} if ratios else None)


# ---------------------------------------------------------------- zero.png

ZERO_GROUPS = [("DDP", "ddp", None), ("FSDP2", "fsdp2", None)] + [
    (f"ZeRO {stage}" + (" +\noffload" if offload else ""), None, (stage, offload))
    for stage, offload in ((0, False), (1, False), (2, False), (2, True), (3, False), (3, True))]
"""(label, torch runtime, (stage, offload) of the engines) per group of bars."""


def _series(row: dict) -> str:
    if row["runtime"] == "deepshard":
        return "deepshard"
    if row["runtime"] == "deepspeed":
        return "DeepSpeed"
    return "torch, AdamW(fused=True)" if row["fused"] else "torch, AdamW for-loop"


def zero_groups(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """The rows that ran, grouped for the bars: DDP, FSDP2, then each ZeRO setup (deepshard
    beside DeepSpeed); ``loss.backward()`` variants and the compute floor are left out."""
    ran = [r for r in rows if r["status"] == "ok" and not r["torch_backward"]]
    groups = []
    for label, torch_runtime, setup in ZERO_GROUPS:
        members = [r for r in ran if (r["runtime"] == torch_runtime if torch_runtime else
                   r["runtime"] in ("deepshard", "deepspeed")
                   and (r["stage"], r["offload"]) == setup)]
        members.sort(key=lambda r: list(COLORS).index(_series(r)))
        if members:
            groups.append((label, members))
    return groups


def quietest_round(row: dict, steps: int) -> float:
    """The median step time of the peer's least disturbed round: ``step_s`` holds its
    rounds' timed steps in order, ``steps`` per round (another job on the machine slows
    whole rounds; this shows how far the all-rounds median is from an undisturbed one)."""
    times = row["step_s"]
    rounds = [sorted(times[i:i + steps]) for i in range(0, len(times), steps)]
    return min(r[len(r) // 2] if len(r) % 2 else (r[len(r) // 2 - 1] + r[len(r) // 2]) / 2
               for r in rounds if r)


def _grouped_bars(ax, groups, value, marks=None, mark_label="each rank", marker=".") -> None:
    """Bars of ``value(row)`` per group; black markers at each of ``marks(row)``."""
    width = 0.38
    for g, (_, members) in enumerate(groups):
        for i, row in enumerate(members):
            x = g + (i - (len(members) - 1) / 2) * width
            series = _series(row)
            ax.bar(x, value(row), width * 0.95, color=COLORS[series], label=series)
            if marks:
                values = marks(row)
                ax.plot([x] * len(values), values, marker, color="black",
                        markersize=3 if marker == "." else 7, label=mark_label)
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _layout(fig, top: float = 1.0) -> None:
    """Tight layout above the footer, leaving ``1 - top`` of the height free at the top."""
    fig.tight_layout(rect=(0, 0.03, 1, top))


def _figure_legend(fig, axes, top: float) -> None:
    """One legend for all ``axes`` (each label once), centred above them."""
    unique: dict = {}
    for ax in axes:
        handles, labels = ax.get_legend_handles_labels()
        unique.update(zip(labels, handles, strict=True))
    fig.legend(unique.values(), unique.keys(), fontsize=8, ncol=4, loc="upper center",
               bbox_to_anchor=(0.5, top + 0.005), frameon=False)


def plot_zero(data: dict):
    """Two panels: rank 0's median step time (a tick at its quietest round's), and peak RSS
    (bar: the higher rank, dots: each rank), per setup; the compute floor as a dashed
    line; one legend above both."""
    groups = zero_groups(data["rows"])
    if not groups:
        raise PlotError("no peer that ran")
    fig, (top, bottom) = _figure(6.6, 2)
    s = data["settings"]
    _grouped_bars(top, groups, lambda r: r["median_s"],
                  marks=lambda r: [quietest_round(r, s["steps"])],
                  mark_label="median of its quietest round", marker="_")
    floor = next((r for r in data["rows"] if r["runtime"] == "floor" and r["status"] == "ok"),
                 None)
    if floor:
        top.axhline(floor["median_s"], color="black", linestyle="--", linewidth=1,
                    label="compute floor (no gradient exchange)")
    top.set_ylabel("s / step (rank 0, median)")
    fig.suptitle(f"ZeRO: GPT 27.4M fp32, {s['world']} CPU ranks x {s['threads_per_rank']} "
                 f"thread, median of {s['rounds']} rounds x {s['steps']} steps", fontsize=10,
                 y=0.995)
    top.set_title("Step time (bar: median of all rounds, tick: of its quietest round)",
                  fontsize=9)
    _grouped_bars(bottom, groups, lambda r: max(r["peak_rss_mib"]),
                  marks=lambda r: r["peak_rss_mib"])
    bottom.set_ylabel("peak RSS per rank (MiB)")
    bottom.set_title("Peak resident memory (bar: the higher rank)", fontsize=9)
    _layout(fig, top=0.95)
    _figure_legend(fig, (top, bottom), 0.96)
    return fig


# ---------------------------------------------------------------- fanout.png

FANOUT_SERIES = (("flat", "ds-run ssh, flat (--fanout 0)", "o-", COLORS["deepshard"]),
                 ("tree", "ds-run ssh, tree (ceil(sqrt(N)) relays)", "D-", "#17becf"),
                 ("pdsh", "pdsh -R ssh -f 256", "s--", "#2ca02c"),
                 ("mpirun", "Open MPI mpirun (ssh)", "^:", "#9467bd"))


def plot_fanout(data: dict):
    """Left: wall time of the trivial job by host count (log-log), the four launchers.
    Right: the coordinator's own CPU seconds, measured, and the fitted model projected to
    4,096 hosts (dashed)."""
    rows = sorted(data["rows"], key=lambda r: r["hosts"])
    if not rows:
        raise PlotError("no rows")
    import matplotlib.pyplot as plt

    fig, (wall, cpu) = plt.subplots(1, 2, figsize=(WIDTH_IN, 4.2), dpi=DPI)
    hosts = [r["hosts"] for r in rows]
    for key, label, style, color in FANOUT_SERIES:
        wall.plot(hosts, [r[f"{key}_s"] for r in rows], style, color=color, label=label)
        cpu.plot(hosts, [r[f"{key}_cpu_s"] for r in rows], style, color=color)
    model = data["settings"].get("cpu_model")
    if model:
        import math

        far = [h for h in (128, 256, 512, 1024, 2048, 4096) if h >= hosts[-1]]
        a, b = model["flat"]
        ta, tb, tc = model["tree"]
        cpu.plot(far, [a + b * n for n in far], "--", color=COLORS["deepshard"], alpha=0.6)
        cpu.plot(far, [ta + tb * math.ceil(math.sqrt(n)) + tc * n for n in far], "--",
                 color="#17becf", alpha=0.6, label="model, projected")
        cpu.legend(fontsize=7, loc="upper left")
    for ax, title, ylabel in (
            (wall, "wall time, start to every worker back", "seconds (median)"),
            (cpu, "the coordinator's own CPU", "CPU seconds (median)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("hosts (namespaces with their own sshd, one worker each)", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    wall.legend(fontsize=7, loc="upper left")
    _layout(fig)
    return fig


# ---------------------------------------------------------------- bubble.png

def bubble_rows(data: dict) -> list[dict]:
    """The sweep's rows that ran, by m, for the first pipeline depth P in the record."""
    rows = sorted((r for r in data["rows"] if r.get("kind") == "bubble"
                   and r["status"] == "ok"), key=lambda r: r["m"])
    if not rows:
        raise PlotError("no bubble rows that ran")
    return [r for r in rows if r["pipe"] == rows[0]["pipe"]]


SERIES = (("bubble_span", "o-", "measured, 1 - busy/span"),
          ("bubble_total", "o--", "measured, 1 - busy/batch"),
          ("simulated", "x:", "1F1B simulator"))
"""(row key, line style, label) of each per-stage series of bubble.png."""


def plot_bubble(data: dict):
    """Idle fraction per stage against m (top) and its distance from the theory (bottom):
    the theory (P-1)/(m+P-1), the 1F1B simulator fed the measured stage costs, and the
    bubble measured over the 1F1B span and over the whole batch."""
    rows = bubble_rows(data)
    pipe, ms = rows[0]["pipe"], [r["m"] for r in rows]
    fig, (top, bottom) = _figure(6.2, 2, (2.2, 1))
    curve = [ms[0] * 2 ** (k / 20) for k in range(int(20 * math.log2(ms[-1] / ms[0])) + 1)]
    top.plot(curve, [(pipe - 1) / (m + pipe - 1) for m in curve], color="black", linewidth=1,
             label=f"theory (P-1)/(m+P-1), P = {pipe}")
    top.plot(ms, [r["theory"] for r in rows], "D", color="black", markersize=4)
    bottom.axhline(0, color="black", linewidth=1)
    for stage in range(pipe):
        for key, style, label in SERIES:
            values = [r[key][stage] for r in rows]
            kwargs = {"color": f"C{stage}", "label": f"{label}, stage {stage}",
                      "markerfacecolor": "white" if "--" in style else None}
            top.plot(ms, values, style, **kwargs)
            bottom.plot(ms, [100 * (v - r["theory"]) / r["theory"]
                             for v, r in zip(values, rows, strict=True)], style, **kwargs)
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.grid(alpha=0.3)
    s = data["settings"]
    top.set_title(f"Pipeline bubble: GPT '{s['bubble_size']}', {pipe} stages on {pipe} ranks, "
                  f"median of {s['steps']} steps", fontsize=10)
    top.set_ylabel("idle fraction of the stage")
    top.set_ylim(bottom=0)
    top.legend(fontsize=7.5, loc="upper right", ncol=2)
    bottom.set_ylabel("off the theory (%)")
    bottom.set_xlabel("micro-batches per step, m")
    _layout(fig)
    return fig


# ---------------------------------------------------------------- launch.png

def plot_launch(data: dict):
    """Median wall time of a trivial 2-worker job per launcher, horizontal bars, log x."""
    rows = sorted(data["rows"], key=lambda r: r["median_s"])
    if not rows:
        raise PlotError("no rows")
    fig, ax = _figure(3.4)
    names = [r["launcher"] for r in rows]
    colors = [COLORS["deepshard"] if n == "ds-run" else COLORS["DeepSpeed"]
              if n == "deepspeed" else "#7f7f7f" for n in names]
    ax.barh(names, [r["median_s"] for r in rows], color=colors)
    for i, r in enumerate(rows):
        ax.text(r["median_s"] * 1.08, i, f"{r['median_s']:.3f} s (ds-run / this: "
                f"{r['ds_run_over']:.2f})", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(min(r["median_s"] for r in rows) / 2, max(r["median_s"] for r in rows) * 12)
    ax.invert_yaxis()
    ax.set_xlabel("median wall time (s, log scale)")
    ax.set_title(f"Launch overhead: trivial 2-worker job, median of "
                 f"{data['settings']['rounds']} alternating rounds", fontsize=10)
    ax.grid(axis="x", alpha=0.3, which="both")
    ax.set_axisbelow(True)
    _layout(fig)
    return fig


# ---------------------------------------------------------------- elastic.png

ELASTIC_PHASES = {"shrink_s": ("relaunch_shrink_s", "node lost\n-> steps on {m}"),
                  "grow_s": ("relaunch_grow_s", "node back\n-> steps on {n}")}
"""Row key of each measured phase of elastic.png -> (its launcher part's key, label)."""
ELASTIC_COLORS = {"ds-run": COLORS["deepshard"], "torchrun": "#7f7f7f"}


def elastic_groups(rows: list[dict]) -> list[tuple[str, list[tuple[str, dict]]]]:
    """(label, [(phase key, row), ...]) per host count and phase, for the rows that ran."""
    ran = [r for r in rows if r["status"] == "ok"]
    if not ran:
        raise PlotError("no row that ran")
    groups = []
    for n in sorted({r["hosts"] for r in ran}):
        members = sorted((r for r in ran if r["hosts"] == n),
                         key=lambda r: list(ELASTIC_COLORS).index(r["launcher"]))
        for key, (_, label) in ELASTIC_PHASES.items():
            groups.append((f"{n} hosts: " + label.format(m=n - 1, n=n),
                           [(key, r) for r in members]))
    return groups


def plot_elastic(data: dict):
    """Seconds to steps again after a node is lost and after it returns, per host count,
    ds-run beside torchrun, hatched up to where the script starts again (the launcher's
    part); a tick at ds-run's shrink target (monitor timeout + 5 s + its checkpoint load)."""
    groups = elastic_groups(data["rows"])
    monitor = data["settings"]["monitor_timeout"]
    fig, ax = _figure(4.4)
    width = 0.38
    for g, (_, members) in enumerate(groups):
        for i, (key, row) in enumerate(members):
            x = g + (i - (len(members) - 1) / 2) * width
            ax.bar(x, row[key], width * 0.95, color=ELASTIC_COLORS[row["launcher"]],
                   label=row["launcher"])
            part = row.get(ELASTIC_PHASES[key][0])
            if part is not None:
                ax.bar(x, part, width * 0.95, fill=False, hatch="///", edgecolor="#333333",
                       linewidth=0, label="of it: the launcher's part (until the script starts)")
            ax.annotate(f"{row[key]:.1f}", (x, row[key]), textcoords="offset points",
                        xytext=(0, 2), ha="center", fontsize=7)
            if key == "shrink_s" and row["launcher"] == "ds-run":
                target = monitor + 5 + (row["load_shrink_s"] or 0.0)
                ax.plot([x - width / 2, x + width / 2], [target] * 2, color="black",
                        linewidth=1.5, label=f"target: --monitor_timeout {monitor:g} s + 5 s "
                        "+ checkpoint load")
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=8)
    ax.set_ylabel("seconds until training steps again")
    ax.set_ylim(0, 1.3 * max(row[key] for _, members in groups for key, row in members))
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7.5, loc="upper center", ncol=2)
    ax.set_title("Elastic training: host 2 killed (every process, its sshd too), then back; "
                 "one worker per host", fontsize=10)
    _layout(fig)
    return fig


# ---------------------------------------------------------------- moe.png

MOE_PANELS = (("tokens_per_s", "tokens / s (4 ranks)", "Throughput (label: deepshard / DeepSpeed)"),
              ("rss", "peak RSS per rank (MiB)", "Peak resident memory (bar: the higher rank)"),
              ("a2a", "all-to-all MiB / step / rank", "Bytes exchanged (tick: theory)"))
"""(value, y label, title) of each panel of moe.png."""


def _moe_value(row: dict, key: str) -> float:
    if key == "rss":
        return max(row["peak_rss_mib"])
    if key == "a2a":
        return row["a2a_bytes_per_step"] / 2**20
    return row[key]


def _moe_marks(row: dict, key: str) -> list[float]:
    if key == "rss":
        return row["peak_rss_mib"]
    if key == "a2a" and row.get("theory_bytes_per_step"):
        return [row["theory_bytes_per_step"] / 2**20]
    return []


def plot_moe(data: dict):
    """Three panels by ep, deepshard beside DeepSpeed: tokens/s (with the ratio), peak RSS
    (dots: each rank), and the measured all-to-all bytes (tick: the theory)."""
    rows = [r for r in data["rows"] if r["status"] == "ok"]
    eps = sorted({r["ep"] for r in rows})
    if not eps:
        raise PlotError("no row that ran")
    groups = [(f"ep {ep}", sorted((r for r in rows if r["ep"] == ep),
                                  key=lambda r: list(COLORS).index(r["impl"])))
              for ep in eps]
    fig, axes = _figure(7.4, 3)
    for ax, (key, ylabel, title) in zip(axes, MOE_PANELS, strict=True):
        _moe_bars(ax, groups, key)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=9)
    for g, (_, members) in enumerate(groups):
        for i, r in enumerate(members):
            if r.get("vs_deepspeed"):
                x = g + (i - (len(members) - 1) / 2) * 0.38
                axes[0].annotate(f"{r['vs_deepspeed']:.2f}x", (x, r["tokens_per_s"]),
                                 textcoords="offset points", xytext=(0, 4), ha="center",
                                 fontsize=8, color=COLORS["deepshard"])
    s = data["settings"]
    fig.suptitle(f"MoE GPT, {s['world']} CPU ranks x {s['threads_per_rank']} thread, ZeRO "
                 f"{s['zero_stage']}, median of {s['steps']} steps", fontsize=10, y=0.995)
    _layout(fig, top=0.93)
    _figure_legend(fig, axes, 0.945)
    return fig


def _moe_bars(ax, groups, key: str) -> None:
    """Bars of the panel's value per ep group, coloured by implementation; black markers
    at its marks (each rank's peak, the theory)."""
    width = 0.38
    marker = "_" if key == "a2a" else "."
    for g, (_, members) in enumerate(groups):
        for i, row in enumerate(members):
            x = g + (i - (len(members) - 1) / 2) * width
            ax.bar(x, _moe_value(row, key), width * 0.95, color=COLORS[row["impl"]],
                   label=row["impl"])
            values = _moe_marks(row, key)
            if values:
                ax.plot([x] * len(values), values, marker, color="black",
                        markersize=3 if marker == "." else 14,
                        label="each rank" if marker == "." else "theory")
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


# ---------------------------------------------------------------- long_seq.png

def _long_seq_lengths(ax, rows: list[dict], budget: float) -> None:
    sizes = sorted({r["sp"] for r in rows})
    width = 0.38
    for i, tiled in enumerate((False, True)):
        for r in (r for r in rows if r["tiled"] == tiled):
            x = sizes.index(r["sp"]) + (i - 0.5) * width
            ax.bar(x, r["max_length"], width * 0.95, color=f"C{i}",
                   hatch="//" if r["capped"] else None,
                   label="tiled MLP + logits" if tiled else "untiled")
            ax.text(x, r["max_length"], (">=" if r["capped"] else "") + str(r["max_length"]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log", base=2)
    ax.set_ylim(top=max(r["max_length"] for r in rows) * 2)
    ax.set_xticks(range(len(sizes)), [f"SP {s}" if s > 1 else "no SP" for s in sizes])
    ax.set_ylabel("max sequence length (tokens)")
    ax.set_title(f"Longest sequence under {budget:.0f} MiB RSS per rank "
                 "(hatched: the search stopped at its cap, a lower bound)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left")


def plot_long_seq(data: dict):
    """Two panels: the longest length under the budget per SP size, untiled and tiled;
    tokens/s of deepshard beside DeepSpeed 0.19.8 at those lengths."""
    rows = [r for r in data["rows"] if r["max_length"]]
    if not rows:
        raise PlotError("no row with a length")
    fig, (top, bottom) = _figure(6.4, 2)
    _long_seq_lengths(top, rows, data["settings"]["budget_mib"])
    width = 0.38
    timed = [r for r in rows if r["deepshard_tok_s"]]
    for j, r in enumerate(timed):
        bottom.bar(j - width / 2, r["deepshard_tok_s"], width * 0.95,
                   color=COLORS["deepshard"], label="deepshard")
        if r["deepspeed_tok_s"]:
            bottom.bar(j + width / 2, r["deepspeed_tok_s"], width * 0.95,
                       color=COLORS["DeepSpeed"], label="DeepSpeed 0.19.8")
    bottom.set_xticks(range(len(timed)), [
        f"SP {r['sp']} {'tiled' if r['tiled'] else 'untiled'}\n{r['max_length']} tokens"
        for r in timed], fontsize=8)
    bottom.set_ylabel("tokens / s (rank 0)")
    bottom.set_title(f"Training throughput at those lengths (mean of "
                     f"{data['settings']['steps']} steps)", fontsize=9)
    bottom.grid(axis="y", alpha=0.3)
    handles, names = bottom.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    bottom.legend(unique.values(), unique.keys(), fontsize=8)
    fig.suptitle("Long sequences: Llama hidden 64, 2 layers, vocab 32000, fp32; CPU ranks "
                 "x 1 thread", fontsize=10)
    _layout(fig, top=0.96)
    return fig


# ---------------------------------------------------------------- data_efficiency.png

EFFICIENCY_COLORS = {"baseline": "#7f7f7f", "curriculum": "#2ca02c", "ltd": "#ff7f0e",
                     "both": "#1f77b4"}


def plot_data_efficiency(data: dict):
    """Validation loss against training wall time, one curve per variant; the baseline's
    final loss (the target) dashed, each variant's crossing of it marked."""
    rows = [r for r in data["rows"] if r["status"] == "ok" and r.get("curve")]
    if not rows:
        raise PlotError("no variant that ran")
    fig, ax = _figure(4.6)
    target = rows[0]["target"]
    for row in rows:
        curve = row["curve"]
        name = row["variant"]
        label = name if row["speedup"] is None or name == "baseline" else \
            f"{name} ({row['speedup']:.2f}x)"
        ax.plot([p["wall_s"] for p in curve], [p["val_loss"] for p in curve],
                color=EFFICIENCY_COLORS.get(name, "black"), label=label, linewidth=1.4)
        if row["wall_to_target_s"] is not None:
            ax.plot([row["wall_to_target_s"]], [target], "o", markersize=4,
                    color=EFFICIENCY_COLORS.get(name, "black"))
    ax.axhline(target, color="black", linestyle="--", linewidth=0.8,
               label=f"baseline's final validation loss {target:.3f}")
    low = min(p["val_loss"] for r in rows for p in r["curve"])
    ax.set_ylim(low - 0.05, target + 1.0)
    ax.set_xlabel("training wall time (s, evaluations excluded)")
    ax.set_ylabel("validation loss (held-out 10%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    s = data["settings"]
    fig.suptitle(f"Data efficiency: small GPT on the standard library's source, "
                 f"{s['steps']} baseline steps, 1 rank x 2 threads", fontsize=10)
    _layout(fig, top=0.95)
    return fig


# ---------------------------------------------------------------- zero_compile.png

COMPILE_SERIES = {("deepshard", False): ("deepshard eager", "#aec7e8"),
                  ("deepshard", True): ("deepshard engine.compile()", COLORS["deepshard"]),
                  ("deepspeed", False): ("DeepSpeed eager", "#ff9896"),
                  ("deepspeed", True): ("DeepSpeed engine.compile()", COLORS["DeepSpeed"])}
"""(runtime, compiled) -> (label, colour) of each bar of a stage's group."""
COMPILE_DDP = {False: ("DDP, AdamW(fused=True)", "--"), True: ("DDP of model.compile()", ":")}
"""compiled -> (label, line style) of the DDP reference lines."""
COMPILE_PANELS = (("median_s", "s / step (rank 0, median)",
                   "Step time after warm-up (label: x faster than the same runtime eager)"),
                  ("compile_s", "first step (s)",
                   "Compile time: the first step's wall time, fresh Inductor cache"),
                  ("rss", "peak RSS per rank (MiB)", "Peak resident memory (bar: the higher "
                   "rank, dots: each rank)"))
"""(value, y label, title) of each panel of zero_compile.png."""


def _compile_value(row: dict, key: str) -> float:
    return max(row["peak_rss_mib"]) if key == "rss" else row[key]


def plot_zero_compile(data: dict):
    """Three panels by ZeRO stage, bars for deepshard and DeepSpeed, eager and compiled:
    step time (compiled bars labelled with their speed-up over eager), compile time and
    peak RSS; DDP eager and compiled as horizontal lines."""
    ran = [r for r in data["rows"] if r["status"] == "ok"]
    engines = [r for r in ran if (r["runtime"], r["compiled"]) in COMPILE_SERIES]
    stages = sorted({r["stage"] for r in engines})
    if not stages:
        raise PlotError("no deepshard or DeepSpeed peer that ran")
    fig, axes = _figure(7.4, 3)
    width = 0.2
    order = list(COMPILE_SERIES)
    for ax, (key, ylabel, title) in zip(axes, COMPILE_PANELS, strict=True):
        for r in engines:
            i = order.index((r["runtime"], r["compiled"]))
            x = stages.index(r["stage"]) + (i - 1.5) * width
            label, color = COMPILE_SERIES[(r["runtime"], r["compiled"])]
            ax.bar(x, _compile_value(r, key), width * 0.95, color=color, label=label)
            if key == "rss":
                ax.plot([x] * len(r["peak_rss_mib"]), r["peak_rss_mib"], ".", color="black",
                        markersize=3, label="each rank")
            if key == "median_s" and r["compiled"] and r["speedup_vs_eager"]:
                ax.annotate(f"{r['speedup_vs_eager']:.2f}x", (x, r["median_s"]),
                            textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
        for r in (r for r in ran if r["runtime"] == "ddp"):
            label, style = COMPILE_DDP[r["compiled"]]
            ax.axhline(_compile_value(r, key), color="black", linestyle=style, linewidth=1,
                       label=label)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # room for the speed-up labels
        ax.set_xticks(range(len(stages)), [f"ZeRO {s}" for s in stages], fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    s = data["settings"]
    fig.suptitle(f"Compiled training (inductor): GPT 27.4M fp32, {s['world']} CPU ranks x "
                 f"{s['threads_per_rank']} thread, median of {s['rounds']} rounds x "
                 f"{s['steps']} steps", fontsize=10, y=0.995)
    _layout(fig, top=0.92)
    _figure_legend(fig, axes, 0.935)
    return fig


# ---------------------------------------------------------------- inference.png

INFERENCE_SERIES = {("hf", 1, "fp32"): ("HF generate, 1 process", "#7f7f7f"),
                    ("deepspeed", 1, "fp32"): ("DeepSpeed tp 1", "#ff9896"),
                    ("deepspeed", 2, "fp32"): ("DeepSpeed tp 2", COLORS["DeepSpeed"]),
                    ("deepspeed-policy", 2, "fp32"): ("DeepSpeed tp 2, policy", "#9467bd"),
                    ("deepshard", 1, "fp32"): ("deepshard tp 1", "#aec7e8"),
                    ("deepshard", 2, "fp32"): ("deepshard tp 2", COLORS["deepshard"]),
                    ("deepshard", 1, "int8"): ("deepshard tp 1 int8", "#98df8a"),
                    ("deepshard", 2, "int8"): ("deepshard tp 2 int8", "#2ca02c")}
"""(peer, tp, dtype) -> (label, colour) of its bars; another that ran is drawn in grey."""
INFERENCE_MISSING_LINES = 8


def _inference_series(row: dict) -> tuple[str, str]:
    key = (row["peer"], row["tp"], row["dtype"])
    return INFERENCE_SERIES.get(key, (f"{row['peer']} tp {row['tp']} {row['dtype']}",
                                      "#c7c7c7"))


def inference_missing(rows: list[dict]) -> list[str]:
    """One line per (peer, tp, dtype, status) with no row that ran on some arch: the archs
    it holds for and that status (the first row's per arch)."""
    ran = {(r["arch"], r["peer"], r["tp"], r["dtype"]) for r in rows if r["status"] == "ok"}
    firsts: dict[tuple, str] = {}
    for r in rows:
        key = (r["arch"], r["peer"], r["tp"], r["dtype"])
        if key not in ran and key not in firsts:
            firsts[key] = r["status"]
    merged: dict[tuple, list[str]] = {}
    for (arch, peer, tp, dtype), status in firsts.items():
        merged.setdefault((peer, tp, dtype, status), []).append(arch)
    lines = []
    for (peer, tp, dtype, status), archs in merged.items():
        line = f"{'/'.join(archs)} {peer} tp {tp} {dtype}: {status}"
        lines.append(line if len(line) <= 130 else line[:127] + "...")
    return lines


def _inference_groups(ran: list[dict]) -> list[tuple[str, int]]:
    """The (arch, batch) groups of bars, archs in run order, batches ascending."""
    archs = list(dict.fromkeys(r["arch"] for r in ran))
    return [(a, b) for a in archs for b in sorted({r["batch"] for r in ran if r["arch"] == a})]


def _inference_bars(ax, ran: list[dict], series: list, groups: list, metric: str) -> None:
    """One bar per row at its group and series; tokens/s labelled; RSS: the higher rank's
    peak, its import baseline hatched over the bar's foot, and a dot per rank."""
    width = 0.8 / len(series)
    for r in ran:
        i = series.index((r["peer"], r["tp"], r["dtype"]))
        x = groups.index((r["arch"], r["batch"])) + (i - (len(series) - 1) / 2) * width
        label, color = _inference_series(r)
        if metric == "tokens_per_s":
            ax.bar(x, r["tokens_per_s"], width * 0.95, color=color, label=label)
            ax.annotate(f"{r['tokens_per_s']:.0f}", (x, r["tokens_per_s"]),
                        textcoords="offset points", xytext=(0, 2), ha="center", fontsize=6,
                        rotation=90)
            continue
        top = max(range(len(r["peak_rss_mib"])), key=lambda k: r["peak_rss_mib"][k])
        ax.bar(x, r["peak_rss_mib"][top], width * 0.95, color=color, label=label)
        ax.bar(x, min(r["import_rss_mib"][top], r["peak_rss_mib"][top]), width * 0.95,
               color="white", alpha=0.55, hatch="////", edgecolor="#555555", linewidth=0,
               label="RSS after imports")
        ax.plot([x] * len(r["peak_rss_mib"]), r["peak_rss_mib"], ".", color="black",
                markersize=3, label="each rank")


def plot_inference(data: dict):
    """Two panels, one group of bars per arch and batch, one bar per peer, tp and dtype that
    ran: tokens/s (labelled) and peak RSS per rank (bar: the higher rank, its import baseline
    hatched; dots: each rank); what did not run, and why, under them."""
    ran = [r for r in data["rows"] if r["status"] == "ok"]
    if not ran:
        raise PlotError("no row that ran")
    order = list(INFERENCE_SERIES)
    series = sorted({(r["peer"], r["tp"], r["dtype"]) for r in ran},
                    key=lambda k: (order.index(k) if k in order else len(order), k))
    groups = _inference_groups(ran)
    fig, axes = _figure(8.0, 2)
    for ax, metric in zip(axes, ("tokens_per_s", "rss"), strict=True):
        _inference_bars(ax, ran, series, groups, metric)
        ax.set_ylim(0, ax.get_ylim()[1] * (1.15 if metric == "tokens_per_s" else 1.05))
        ax.set_xticks(range(len(groups)), [f"{a} batch {b}" for a, b in groups], fontsize=8)
        for k in range(1, len(groups)):
            if groups[k][0] != groups[k - 1][0]:
                ax.axvline(k - 0.5, color="#999999", linewidth=0.8, linestyle=":")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].set_ylabel("tokens / s", fontsize=8)
    axes[0].set_title("Generation throughput (batch x new tokens / generate wall time)",
                      fontsize=9)
    axes[1].set_ylabel("peak RSS per rank (MiB)", fontsize=8)
    axes[1].set_title("Peak resident memory (bar: the higher rank, hatched: its RSS after "
                      "the imports; dots: each rank)", fontsize=9)
    missing = inference_missing(data["rows"])
    if missing:
        shown = missing[:INFERENCE_MISSING_LINES]
        more = len(missing) - len(shown)
        axes[1].set_xlabel("did not run:\n" + "\n".join(shown)
                           + (f"\n... and {more} more" if more else ""), fontsize=6, loc="left")
    s = data["settings"]
    models = " and ".join(m["title"] for m in s["models"].values())
    fig.suptitle(f"Greedy generation on CPU: {models}, random weights\nprompt "
                 f"{s['prompt_len']}, {s['tokens']} new tokens, {s['cores']} cores per launch"
                 + (" (--quick)" if s.get("quick") else ""), fontsize=10, y=0.995)
    _layout(fig, top=0.93)  # tight_layout already keeps the two-line title clear
    _inference_legend(fig, axes, [_inference_series({"peer": p, "tp": t, "dtype": d})[0]
                                  for p, t, d in series])
    return fig


def _inference_legend(fig, axes, order: list[str]) -> None:
    """One legend above both panels, five columns: the series in ``order``, then the marks."""
    handles: dict = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    labels = [x for x in order if x in handles] + [x for x in handles if x not in order]
    fig.legend([handles[x] for x in labels], labels, fontsize=7, ncol=5, loc="upper center",
               bbox_to_anchor=(0.5, 0.94), frameon=False)


# ---------------------------------------------------------------- zeropp.png

ZEROPP_COLORS = {"deepshard": COLORS["deepshard"], "deepspeed": COLORS["DeepSpeed"]}


def plot_zeropp(data: dict):
    """Top: seconds per step of each variant (deepshard, then DeepSpeed's) at each link
    speed, labelled with its ratio to the same runtime's plain ZeRO-3. Bottom: MB crossing
    hosts per step (the same at every speed: the first one's)."""
    ran = [r for r in data["rows"] if r["status"] == "ok"]
    if not ran:
        raise PlotError("no row that ran")
    rates = list(dict.fromkeys(r["rate"] for r in ran))
    bars = list(dict.fromkeys((r["runtime"], r["variant"]) for r in ran))
    fig, (top, bottom) = _figure(6.4, 2)
    width = 0.8 / len(rates)
    for k, rate in enumerate(rates):
        for i, (runtime, variant) in enumerate(bars):
            row = next((r for r in ran if (r["runtime"], r["variant"], r["rate"]) ==
                        (runtime, variant, rate)), None)
            base = next((r for r in ran if (r["runtime"], r["variant"], r["rate"]) ==
                         (runtime, "ZeRO-3", rate)), None)
            if row is None:
                continue
            x = i + (k - (len(rates) - 1) / 2) * width
            top.bar(x, row["step_s"], width * 0.95, color=ZEROPP_COLORS[runtime],
                    alpha=1.0 - 0.45 * k, label=f"{runtime}, {rate}" if i == 0 or
                    (runtime, variant) == next(b for b in bars if b[0] == runtime) else None)
            if base is not None:
                top.annotate(f"{row['step_s'] / base['step_s']:.2f}x", (x, row["step_s"]),
                             textcoords="offset points", xytext=(0, 2), ha="center",
                             fontsize=6)
    first = [next(r for r in ran if (r["runtime"], r["variant"]) == b and
                  r["rate"] == rates[0]) for b in bars]
    bottom.bar(range(len(bars)), [r["cross_host_bytes"] / 1e6 for r in first], 0.6,
               color=[ZEROPP_COLORS[r["runtime"]] for r in first])
    for i, r in enumerate(first):
        bottom.annotate(f"{r['cross_host_bytes'] / 1e6:.0f}", (i, r["cross_host_bytes"] / 1e6),
                        textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
    labels = [f"{v}\n({'DeepSpeed' if rt == 'deepspeed' else 'deepshard'})" for rt, v in bars]
    for ax in (top, bottom):
        ax.set_xticks(range(len(bars)), labels, fontsize=7)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    handles, names = top.get_legend_handles_labels()
    seen = dict(zip(names, handles, strict=True))
    top.set_ylim(0, top.get_ylim()[1] * 1.25)
    top.legend(seen.values(), seen.keys(), fontsize=7, loc="upper center", ncol=4)
    top.set_ylabel("seconds per step (median)", fontsize=8)
    top.set_title("Stage 3 on 2 hosts x 2 ranks, links capped with tc (labels: vs the "
                  "runtime's plain ZeRO-3)", fontsize=9)
    bottom.set_ylabel("MB crossing hosts per step", fontsize=8)
    bottom.set_title("Traffic between the hosts (each host's eth0 transmit counter)",
                     fontsize=9)
    _layout(fig)
    return fig


# ---------------------------------------------------------------- command line

DRAW = {"zero": plot_zero, "fanout": plot_fanout, "bubble": plot_bubble, "launch": plot_launch,
        "elastic": plot_elastic, "moe": plot_moe, "long_seq": plot_long_seq,
        "data_efficiency": plot_data_efficiency, "zero_compile": plot_zero_compile,
        "inference": plot_inference, "zeropp": plot_zeropp}


def draw(name: str, results: Path, out: Path) -> Path:
    """Read ``name``'s record from ``results`` and write ``out/<name>.png``; its path."""
    import matplotlib.pyplot as plt

    path = results / f"{PLOTS[name]}.json"
    data = read(path, PLOTS[name])
    try:
        fig = DRAW[name](data)
    except PlotError as exc:
        raise PlotError(f"{path}: {exc}") from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        what = f"missing field {exc}" if isinstance(exc, KeyError) else f"bad field: {exc}"
        raise PlotError(f"{path}: {what}") from None
    footer(fig, data)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{name}.png"
    fig.savefig(target, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return target


def main(argv: list[str] | None = None) -> int:
    """Draw the plots; 0, or 2 with one line on stderr when a record cannot be drawn."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder of the benchmarks' JSON records (default benchmarks/results)")
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the PNGs "
                        "(default docs/plots)")
    parser.add_argument("--only", default=",".join(PLOTS),
                        help=f"comma-separated subset of {', '.join(PLOTS)}")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLOTS]
    if unknown:
        parser.error(f"unknown plot {unknown[0]!r}; choose from {', '.join(PLOTS)}")
    try:
        import matplotlib
    except ImportError:
        print("plot.py: matplotlib is not installed: pip install matplotlib "
              "(or deepshard[plot])", file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    for name in names:
        try:
            print(f"wrote {draw(name, args.results, args.out)}")
        except (RecordError, PlotError) as exc:
            print(f"plot.py: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
