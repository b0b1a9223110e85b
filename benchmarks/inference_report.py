"""The report of ``benchmarks/inference.py``: its rows turned into the table, the ratios the
issue targets and their verdicts, and the module types each tensor-parallel engine left.

inference.py runs one configuration per launch (arch, peer, tp, dtype, batch) and makes one
row of each (``inference_worker.py`` says how each number is measured); this module only
compares rows with each other, torch-free and standard library only like the rest of the
parent, so that ``plot.py`` and the unit tests can use it. Rows are only ever compared
within one arch.

A row is a dict: ``arch`` (``gpt2``, ``llama``), ``peer``, ``runtime`` (``hf``,
``deepspeed`` or ``deepshard``), ``tp``, ``dtype`` (``fp32`` or ``int8``), ``batch``,
``status`` (``ok``, ``not runnable: ...``, ``failed: ...`` or ``skipped: ...``) and, when
``ok``: ``first_token_ms``, ``tokens_per_s``, ``peak_rss_mib``, ``import_rss_mib`` and
``work_rss_mib`` (one per rank: the peak, the RSS right after the imports, and the peak above
that), ``tokens_equal_hf``, ``first_difference``, ``ranks_agree``, ``agreement``,
``perplexity`` and what ``add_ratios`` adds.

Targets (issue "Inference: init_inference with tensor parallelism and int8 weights"),
each printed with ``met``, ``MISSED`` or ``not measured (<why>)``, per arch and batch:

* deepshard tp 2 tokens/s at least ``SPEED_VS_DEEPSPEED`` (1.2x) DeepSpeed's tp 2; where
  DeepSpeed cannot run an arch at tp 2 (GPT-2 on CPU), the line says so and gives the
  other arch's ratio (LLaMA's, which DeepSpeed's AutoTP takes);
* deepshard tp 2 peak RSS per rank (the higher rank) at most ``RSS_VS_HF`` (0.6x) of HF
  generate's in one process; the same ratio of the parts above the import baseline (the
  RSS after importing torch, transformers and the library, before any model: about the
  same for every peer, ``import_baselines``) is printed beside it, not judged;
* deepshard int8 tokens/s at least ``INT8_SPEEDUP`` (1.3x) its fp32, at each tp;
* deepshard int8 perplexity within ``PERPLEXITY_TOLERANCE`` (2%) of its fp32, at each tp.
"""

from __future__ import annotations

SPEED_VS_DEEPSPEED = 1.2
RSS_VS_HF = 0.6
INT8_SPEEDUP = 1.3
PERPLEXITY_TOLERANCE = 0.02
TP_TARGET = 2
"""The tensor-parallel degree of the speed and memory targets."""
MODULE_PREFIXES = ("transformer.", "model.")
"""Dropped from module names in ``layers``' lines."""


def key(row: dict) -> tuple:
    """A row's configuration: (arch, peer, tp, dtype, batch)."""
    return (row["arch"], row["peer"], row["tp"], row["dtype"], row["batch"])


def _ran(rows: list[dict]) -> dict[tuple, dict]:
    return {key(r): r for r in rows if r["status"] == "ok"}


def _archs(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["arch"] for r in rows))


def add_ratios(rows: list[dict]) -> list[dict]:
    """``rows`` with, where both sides ran (same arch and batch): ``vs_deepspeed``
    (tokens/s over DeepSpeed's at the same tp, fp32), ``rss_vs_hf`` and ``work_vs_hf``
    (the higher rank's peak RSS, and its part above the imports, over HF's one process)
    for deepshard; ``speed_vs_fp32`` and ``perplexity_vs_fp32`` for int8."""
    ran = _ran(rows)
    out = []
    for row in rows:
        row = dict(row)
        if row["status"] == "ok":
            arch, batch = row["arch"], row["batch"]
            twin = ran.get((arch, row["peer"], row["tp"], "fp32", batch)) \
                if row["dtype"] == "int8" else None
            if twin:
                row["speed_vs_fp32"] = row["tokens_per_s"] / twin["tokens_per_s"]
                row["perplexity_vs_fp32"] = row["perplexity"] / twin["perplexity"]
            if row["runtime"] == "deepshard":
                ds = ran.get((arch, "deepspeed", row["tp"], "fp32", batch))
                hf = ran.get((arch, "hf", 1, "fp32", batch))
                row["vs_deepspeed"] = row["tokens_per_s"] / ds["tokens_per_s"] if ds else None
                row["rss_vs_hf"] = _rss_ratio(row, hf, "peak_rss_mib") if hf else None
                row["work_vs_hf"] = _rss_ratio(row, hf, "work_rss_mib") if hf else None
        out.append(row)
    return out


def _rss_ratio(ours: dict, hf: dict, field: str) -> float:
    """The higher rank's ``field`` over HF's one process's."""
    return max(ours[field]) / max(hf[field])


def _equal(row: dict) -> str:
    if row["tokens_equal_hf"]:
        return "yes"
    return f"no (from token {row['first_difference']})"


def _perplexity(row: dict) -> str:
    ratio = row.get("perplexity_vs_fp32")
    return f"{row['perplexity']:.1f}" + (f" ({ratio:.4f}x fp32)" if ratio else "")


def _notes(row: dict) -> str:
    notes = [f"{row['threads_per_rank']} thread(s)/rank", f"load {row['load_s']:.1f} s"]
    if len(row["wall_s"]) > 1:
        notes.append(f"generate {min(row['wall_s']):.2f}-{max(row['wall_s']):.2f} s "
                     f"over {len(row['wall_s'])} runs")
    if row.get("speed_vs_fp32"):
        notes.append(f"{row['speed_vs_fp32']:.2f}x fp32 tokens/s")
    if row.get("vs_deepspeed"):
        notes.append(f"{row['vs_deepspeed']:.2f}x DeepSpeed tokens/s")
    if row.get("rss_vs_hf"):
        notes.append(f"{row['rss_vs_hf']:.2f}x HF's peak RSS ({row['work_vs_hf']:.2f}x above "
                     "imports)")
    if not row["ranks_agree"]:
        notes.append("RANKS' TOKENS DIFFER")
    if row["streamed"] != row["tokens"] + 1:
        notes.append(f"streamer saw {row['streamed']} puts, expected {row['tokens'] + 1}")
    return "; ".join(notes)


def table(rows: list[dict]) -> list[str]:
    """The markdown table, one line per row (``add_ratios``' rows)."""
    lines = ["| arch | peer | tp | dtype | batch | first token (ms) | tokens/s | peak RSS per "
             "rank (MiB) | above imports per rank (MiB) | tokens = HF | top-1 agreement | "
             "perplexity | notes |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        head = f"| {r['arch']} | {r['peer']} | {r['tp']} | {r['dtype']} | {r['batch']} |"
        if r["status"] != "ok":
            why = r["status"].replace("|", "\\|")
            lines.append(f"{head} - | - | - | - | - | - | - | {why} |")
            continue
        rss, work = (" / ".join(f"{m:.0f}" for m in r[f]) for f in ("peak_rss_mib",
                                                                      "work_rss_mib"))
        lines.append(f"{head} {r['first_token_ms']:.1f} | {r['tokens_per_s']:.1f} | {rss} | "
                     f"{work} | {_equal(r)} | {r['agreement']:.3f} | {_perplexity(r)} | "
                     f"{_notes(r)} |")
    return lines


def import_baselines(rows: list[dict]) -> list[str]:
    """One line: each runtime's RSS right after its imports, over every rank and launch that
    ran, and how far apart they are: what "above imports" subtracts."""
    seen: dict[str, list[float]] = {}
    for r in rows:
        if r["status"] == "ok":
            seen.setdefault(r["runtime"], []).extend(r["import_rss_mib"])
    if not seen:
        return []
    every = [m for values in seen.values() for m in values]
    parts = ", ".join(f"{runtime} {min(v):.0f}-{max(v):.0f} MiB" for runtime, v in seen.items())
    return [f"Import baseline (RSS per rank right after importing torch, transformers and the "
            f"peer's library, before any model): {parts}; the same for every peer within "
            f"{max(every) - min(every):.0f} MiB. \"above imports\" = each rank's peak RSS - its "
            f"own baseline: the weights and the work."]


def _why_missing(rows: list[dict], keys: list[tuple]) -> str | None:
    """Why the first of ``keys`` that did not run has no number: its status, or "not run"."""
    ran = _ran(rows)
    by_key = {key(r): r for r in rows}
    for k in keys:
        if k not in ran:
            _, peer, tp, dtype, batch = k
            status = by_key[k]["status"] if k in by_key else "not run"
            return f"{peer} tp {tp} {dtype} batch {batch}: {status}"
    return None


def _verdict(head: str, rows: list[dict], keys: list[tuple], measure) -> str:
    """``head: <value>, met|MISSED`` where ``measure(*rows of keys)`` gives (text, met)."""
    why = _why_missing(rows, keys)
    if why:
        return f"{head}: not measured ({why})"
    text, met = measure(*(_ran(rows)[k] for k in keys))
    return f"{head}: {text}, {'met' if met else 'MISSED'}"


def _speed(ours: dict, deepspeed: dict) -> tuple[str, bool]:
    ratio = ours["tokens_per_s"] / deepspeed["tokens_per_s"]
    return f"{ratio:.2f}x", ratio >= SPEED_VS_DEEPSPEED


def _rss(ours: dict, hf: dict) -> tuple[str, bool]:
    peak, hf_peak = max(ours["peak_rss_mib"]), max(hf["peak_rss_mib"])
    work, hf_work = max(ours["work_rss_mib"]), max(hf["work_rss_mib"])
    return (f"{peak:.0f} MiB vs {hf_peak:.0f} MiB = {peak / hf_peak:.2f}x (above imports: "
            f"{work:.0f} MiB vs {hf_work:.0f} MiB = {work / hf_work:.2f}x)",
            peak <= RSS_VS_HF * hf_peak)


def _int8_speed(int8: dict, fp32: dict) -> tuple[str, bool]:
    ratio = int8["tokens_per_s"] / fp32["tokens_per_s"]
    return f"{ratio:.2f}x", ratio >= INT8_SPEEDUP


def _int8_perplexity(int8: dict, fp32: dict) -> tuple[str, bool]:
    change = int8["perplexity"] / fp32["perplexity"] - 1
    return (f"{int8['perplexity']:.2f} vs {fp32['perplexity']:.2f} ({change:+.2%})",
            abs(change) <= PERPLEXITY_TOLERANCE)


def _speed_lines(rows: list[dict], arch: str, b: int) -> list[str]:
    """The tp-2-versus-DeepSpeed target on ``arch``; where DeepSpeed refused its tp 2 on
    ``arch``, the ratio on another arch it did run, and a context line: the ratio to its
    tp 1."""
    ours = (arch, "deepshard", TP_TARGET, "fp32", b)
    theirs = (arch, "deepspeed", TP_TARGET, "fp32", b)
    line = _verdict(f"target {arch} batch {b}: deepshard tp {TP_TARGET} tokens/s >= "
                    f"{SPEED_VS_DEEPSPEED}x DeepSpeed tp {TP_TARGET}", rows, [ours, theirs],
                    _speed)
    refused = next((r for r in rows if key(r) == theirs), {}).get("status", "")
    if not refused.startswith("not runnable"):
        return [line]
    ran = _ran(rows)
    for other in _archs(rows):
        keys = [(other, *ours[1:]), (other, *theirs[1:])]
        if other != arch and not _why_missing(rows, keys):
            text, met = _speed(*(ran[k] for k in keys))
            line += (f"; measured on {other} instead, which DeepSpeed runs at tp {TP_TARGET}: "
                     f"{text}, {'met' if met else 'MISSED'}")
            break
    context = (arch, "deepspeed", 1, "fp32", b)
    if _why_missing(rows, [ours, context]):
        return [line]
    return [line, f"  context {arch} batch {b}: deepshard tp {TP_TARGET} / DeepSpeed tp 1 "
                  f"tokens/s = {_speed(ran[ours], ran[context])[0]}"]


def targets(rows: list[dict]) -> list[str]:
    """One line per target, arch and batch (and tp, for int8), in the order of the module
    docstring; where DeepSpeed refused an arch's tp 2, another arch's ratio and a context
    line with its tp 1."""
    batches = sorted({r["batch"] for r in rows})
    lines = []
    for arch in _archs(rows):
        tps = sorted({r["tp"] for r in rows if r["runtime"] == "deepshard"
                      and r["arch"] == arch})
        for b in batches:
            lines += _speed_lines(rows, arch, b)
            lines.append(_verdict(
                f"target {arch} batch {b}: deepshard tp {TP_TARGET} peak RSS per rank <= "
                f"{RSS_VS_HF}x HF generate's (one process)", rows,
                [(arch, "deepshard", TP_TARGET, "fp32", b), (arch, "hf", 1, "fp32", b)], _rss))
            for tp in tps:
                keys = [(arch, "deepshard", tp, "int8", b), (arch, "deepshard", tp, "fp32", b)]
                lines.append(_verdict(f"target {arch} batch {b}: deepshard tp {tp} int8 "
                                      f"tokens/s >= {INT8_SPEEDUP}x fp32", rows, keys,
                                      _int8_speed))
                lines.append(_verdict(f"target {arch} batch {b}: deepshard tp {tp} int8 "
                                      f"perplexity within {PERPLEXITY_TOLERANCE:.0%} of fp32",
                                      rows, keys, _int8_perplexity))
    return lines


def _short(name: str) -> str:
    for prefix in MODULE_PREFIXES:
        name = name.removeprefix(prefix)
    return name


def layers(rows: list[dict]) -> list[str]:
    """Per arch, peer, tp and dtype that ran (its first batch): the module types and weight
    shapes rank 0 saw after ``init_inference`` (``inference_worker.Arch.layers``)."""
    lines, seen = [], set()
    for r in rows:
        config = key(r)[:4]
        if r["status"] != "ok" or config in seen or not r.get("layers"):
            continue
        seen.add(config)
        parts = ", ".join(f"{_short(name)} {kind}" for name, kind in r["layers"].items())
        lines.append(f"- {r['arch']} {r['peer']} tp {r['tp']} {r['dtype']}: {parts}")
    return lines
