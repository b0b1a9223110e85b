"""The report of ``benchmarks/inference.py``: its rows turned into the table, the ratios the
issue targets and their verdicts, and the module types each tensor-parallel engine left.

inference.py runs one configuration per launch (peer, tp, dtype, batch) and makes one row
of each (its docstring says how each number is measured); this module only compares rows
with each other, torch-free and standard library only like the rest of the parent, so that
``plot.py`` and the unit tests can use it.

A row is a dict: ``peer``, ``runtime`` (``hf``, ``deepspeed`` or ``deepshard``), ``tp``,
``dtype`` (``fp32`` or ``int8``), ``batch``, ``status`` (``ok``, ``not runnable: ...``,
``failed: ...`` or ``skipped: ...``) and, when ``ok``: ``first_token_ms``,
``tokens_per_s``, ``peak_rss_mib`` (one per rank), ``tokens_equal_hf``,
``first_difference``, ``ranks_agree``, ``agreement``, ``perplexity`` and what
``add_ratios`` adds.

Targets (issue "Inference: init_inference with tensor parallelism and int8 weights"),
each printed with ``met``, ``MISSED`` or ``not measured (<why>)``, per batch:

* deepshard tp 2 tokens/s at least ``SPEED_VS_DEEPSPEED`` (1.2x) DeepSpeed's tp 2;
* deepshard tp 2 peak RSS per rank (the higher rank) at most ``RSS_VS_HF`` (0.6x) of HF
  generate's in one process;
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
LAYER_NAMES = ("transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
               "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj", "lm_head")
"""The modules whose type and weight shape each worker reports after ``init_inference``:
the embedding, a block's four projections (GPT-2's ``Conv1D``) and the head."""


def _ran(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["peer"], r["tp"], r["dtype"], r["batch"]): r for r in rows if r["status"] == "ok"}


def _fp32_twin(row: dict, ran: dict[tuple, dict]) -> dict | None:
    """The fp32 row of the same peer, tp and batch as an int8 ``row``."""
    return ran.get((row["peer"], row["tp"], "fp32", row["batch"]))


def add_ratios(rows: list[dict]) -> list[dict]:
    """``rows`` with, where both sides ran: ``vs_deepspeed`` (tokens/s over DeepSpeed's at the
    same tp, fp32, batch), ``rss_vs_hf`` (the higher rank's peak RSS over HF's one process at
    the same batch) for deepshard; ``speed_vs_fp32`` and ``perplexity_vs_fp32`` for int8."""
    ran = _ran(rows)
    out = []
    for row in rows:
        row = dict(row)
        if row["status"] == "ok":
            twin = _fp32_twin(row, ran) if row["dtype"] == "int8" else None
            if twin:
                row["speed_vs_fp32"] = row["tokens_per_s"] / twin["tokens_per_s"]
                row["perplexity_vs_fp32"] = row["perplexity"] / twin["perplexity"]
            if row["runtime"] == "deepshard":
                ds = ran.get(("deepspeed", row["tp"], "fp32", row["batch"]))
                hf = ran.get(("hf", 1, "fp32", row["batch"]))
                row["vs_deepspeed"] = row["tokens_per_s"] / ds["tokens_per_s"] if ds else None
                row["rss_vs_hf"] = (max(row["peak_rss_mib"]) / max(hf["peak_rss_mib"])
                                    if hf else None)
        out.append(row)
    return out


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
        notes.append(f"{row['rss_vs_hf']:.2f}x HF's RSS")
    if not row["ranks_agree"]:
        notes.append("RANKS' TOKENS DIFFER")
    if row["streamed"] != row["tokens"] + 1:
        notes.append(f"streamer saw {row['streamed']} puts, expected {row['tokens'] + 1}")
    return "; ".join(notes)


def table(rows: list[dict]) -> list[str]:
    """The markdown table, one line per row (``add_ratios``' rows)."""
    lines = ["| peer | tp | dtype | batch | first token (ms) | tokens/s | peak RSS per rank "
             "(MiB) | tokens = HF | top-1 agreement | perplexity | notes |",
             "|---|---:|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        head = f"| {r['peer']} | {r['tp']} | {r['dtype']} | {r['batch']} |"
        if r["status"] != "ok":
            why = r["status"].replace("|", "\\|")
            lines.append(f"{head} - | - | - | - | - | - | {why} |")
            continue
        rss = " / ".join(f"{m:.0f}" for m in r["peak_rss_mib"])
        lines.append(f"{head} {r['first_token_ms']:.1f} | {r['tokens_per_s']:.1f} | {rss} | "
                     f"{_equal(r)} | {r['agreement']:.3f} | {_perplexity(r)} | {_notes(r)} |")
    return lines


def _why_missing(rows: list[dict], keys: list[tuple]) -> str | None:
    """Why the first of ``keys`` that did not run has no number: its status, or "not run"."""
    ran = _ran(rows)
    by_key = {(r["peer"], r["tp"], r["dtype"], r["batch"]): r for r in rows}
    for key in keys:
        if key not in ran:
            peer, tp, dtype, batch = key
            status = by_key[key]["status"] if key in by_key else "not run"
            return f"{peer} tp {tp} {dtype} batch {batch}: {status}"
    return None


def _verdict(head: str, rows: list[dict], keys: list[tuple], measure) -> str:
    """``head: <value>, met|MISSED`` where ``measure(*rows of keys)`` gives (text, met)."""
    why = _why_missing(rows, keys)
    if why:
        return f"{head}: not measured ({why})"
    ran = _ran(rows)
    text, met = measure(*(ran[k] for k in keys))
    return f"{head}: {text}, {'met' if met else 'MISSED'}"


def targets(rows: list[dict]) -> list[str]:
    """One line per target and batch (and tp, for int8), in the order of the module
    docstring; a context line with DeepSpeed's tp 1 where its tp 2 did not run."""
    batches = sorted({r["batch"] for r in rows})
    tps = sorted({r["tp"] for r in rows if r["runtime"] == "deepshard"})
    lines = []
    for b in batches:
        ours = ("deepshard", TP_TARGET, "fp32", b)
        lines.append(_verdict(
            f"target batch {b}: deepshard tp {TP_TARGET} tokens/s >= {SPEED_VS_DEEPSPEED}x "
            f"DeepSpeed tp {TP_TARGET}", rows, [ours, ("deepspeed", TP_TARGET, "fp32", b)],
            lambda o, d: (f"{o['tokens_per_s'] / d['tokens_per_s']:.2f}x",
                          o["tokens_per_s"] / d["tokens_per_s"] >= SPEED_VS_DEEPSPEED)))
        context = ("deepspeed", 1, "fp32", b)
        if _why_missing(rows, [("deepspeed", TP_TARGET, "fp32", b)]) \
                and not _why_missing(rows, [ours, context]):
            ran = _ran(rows)
            ratio = ran[ours]["tokens_per_s"] / ran[context]["tokens_per_s"]
            lines.append(f"  context batch {b}: deepshard tp {TP_TARGET} / DeepSpeed tp 1 "
                         f"tokens/s = {ratio:.2f}x")
        lines.append(_verdict(
            f"target batch {b}: deepshard tp {TP_TARGET} peak RSS per rank <= {RSS_VS_HF}x "
            f"HF generate's (one process)", rows, [ours, ("hf", 1, "fp32", b)],
            lambda o, h: (f"{max(o['peak_rss_mib']):.0f} MiB vs {max(h['peak_rss_mib']):.0f} "
                          f"MiB = {max(o['peak_rss_mib']) / max(h['peak_rss_mib']):.2f}x",
                          max(o["peak_rss_mib"]) <= RSS_VS_HF * max(h["peak_rss_mib"]))))
        for tp in tps:
            keys = [("deepshard", tp, "int8", b), ("deepshard", tp, "fp32", b)]
            lines.append(_verdict(
                f"target batch {b}: deepshard tp {tp} int8 tokens/s >= {INT8_SPEEDUP}x fp32",
                rows, keys, lambda i, f: (f"{i['tokens_per_s'] / f['tokens_per_s']:.2f}x",
                                          i["tokens_per_s"] / f["tokens_per_s"] >= INT8_SPEEDUP)))
            lines.append(_verdict(
                f"target batch {b}: deepshard tp {tp} int8 perplexity within "
                f"{PERPLEXITY_TOLERANCE:.0%} of fp32", rows, keys,
                lambda i, f: (f"{i['perplexity']:.2f} vs {f['perplexity']:.2f} "
                              f"({i['perplexity'] / f['perplexity'] - 1:+.2%})",
                              abs(i["perplexity"] / f["perplexity"] - 1) <= PERPLEXITY_TOLERANCE)))
    return lines


def layers(rows: list[dict]) -> list[str]:
    """Per peer, tp and dtype that ran (its first batch): the module types and weight shapes
    rank 0 saw after ``init_inference`` (``LAYER_NAMES``)."""
    lines, seen = [], set()
    for r in rows:
        key = (r["peer"], r["tp"], r["dtype"])
        if r["status"] != "ok" or key in seen or not r.get("layers"):
            continue
        seen.add(key)
        parts = ", ".join(f"{name.removeprefix('transformer.')} {kind}"
                          for name, kind in r["layers"].items())
        lines.append(f"- {r['peer']} tp {r['tp']} {r['dtype']}: {parts}")
    return lines
