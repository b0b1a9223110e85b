"""``log_summary()`` and the logger's read-outs, with DeepSpeed's names and table.

The table goes to stdout on rank 0 (it is what the caller asked to see, as in DeepSpeed);
every rank can have the same figures back as a dict (``return_dict=True``). The barriers
that line the ranks up around it are torch's own, so they are not recorded (DeepSpeed
records them as ``log_summary_barrier``).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from deepshard.comm.logger import OpRecord, comms_logger, convert_size, summarise, trim_mean

COLUMNS = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
           "tput_avg (Gbps)", "busbw_avg (Gbps)")
STRAGGLER_COLUMNS = ("Comm. Op", "Message Size", "Count", "Total comm lat(ms)",
                     "Total straggler(ms)", "Avg comm lat(ms)", "Avg straggler(ms)")
WIDTH = 20


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict | None:
    """Print the per-op table on rank 0 (every rank must call it: it synchronises them).

    ``show_straggler``: also, per op, the latency every rank agrees on (the minimum over
    ranks) and the time each waited on the slowest (needs an all-reduce per op and size,
    so every rank must have recorded the same ops). ``return_dict``: return DeepSpeed's
    ``{"summary", "straggler_analysis", "metadata"}`` dict on every rank.
    """
    initialised = dist.is_initialized()
    if initialised:
        dist.barrier()
    rank = dist.get_rank() if initialised else 0
    result = summary_dict(show_straggler)
    if rank == 0:
        print(render(result), flush=True)
    if initialised:
        dist.barrier()
    return result if return_dict else None


def summary_dict(show_straggler: bool = False) -> dict[str, Any]:
    """The figures :func:`log_summary` prints (straggler analysis: a collective)."""
    records = {name: dict(sizes) for name, sizes in comms_logger.comms_dict.items()}
    initialised = dist.is_initialized()
    return {
        "summary": {name: {size: summarise(size, sizes[size]) for size in sorted(sizes)}
                    for name, sizes in records.items()},
        "straggler_analysis": straggler_analysis(records) if show_straggler else None,
        "metadata": {"world_size": dist.get_world_size() if initialised else 1,
                     "rank": dist.get_rank() if initialised else 0,
                     "timestamp": datetime.datetime.now().isoformat()},
    }


def straggler_analysis(records: dict[str, dict[int, OpRecord]]) -> dict[str, Any]:
    """Per op and size: the minimum latency over ranks, and how long this rank waited
    beyond it (DeepSpeed's "straggler effect")."""
    import torch

    from deepshard.accelerator import get_accelerator

    device = get_accelerator().current_device_name()
    analysis: dict[str, Any] = {}
    for name, sizes in records.items():
        analysis[name] = {}
        for size in sorted(sizes):
            lats = torch.tensor(sizes[size].latencies_ms, dtype=torch.float64, device=device)
            fastest = lats.clone()
            if dist.is_initialized():
                dist.all_reduce(fastest, op=dist.ReduceOp.MIN)
            waits = (lats - fastest).tolist()
            analysis[name][size] = {
                "count": sizes[size].count, "total_comm_lat_ms": fastest.sum().item(),
                "total_straggler_ms": sum(waits), "avg_comm_lat_ms": trim_mean(fastest.tolist()),
                "avg_straggler_ms": trim_mean(waits), "msg_size_bytes": size,
                "msg_size_str": convert_size(size)}
    return analysis


def render(result: dict[str, Any]) -> str:
    """DeepSpeed's table: a header, then each op's name and a row per message size."""
    lines = [_row(COLUMNS)]
    for name, sizes in result["summary"].items():
        lines.append(name)
        for row in sizes.values():
            lines.append(_row(("", row["msg_size_str"], row["count"], row["total_latency_ms"],
                               row["avg_latency_ms"], row["tput_avg_gbps"],
                               row["busbw_avg_gbps"])))
    if result["straggler_analysis"] is not None:
        lines += ["_" * 31, "Breakdown with straggler effect", "-" * 31,
                  _row(STRAGGLER_COLUMNS)]
        for name, sizes in result["straggler_analysis"].items():
            lines.append(name)
            for row in sizes.values():
                lines.append(_row(("", row["msg_size_str"], row["count"],
                                   row["total_comm_lat_ms"], row["total_straggler_ms"],
                                   row["avg_comm_lat_ms"], row["avg_straggler_ms"])))
    return "\n".join(lines)


def _row(cells: tuple[Any, ...]) -> str:
    return "".join(f"{c: <{WIDTH}.2f}" if isinstance(c, float) else f"{c!s: <{WIDTH}}"
                   for c in cells).rstrip()


def reset_log() -> None:
    """Forget every record (e.g. per epoch)."""
    comms_logger.reset_data()


def has_comm_data() -> bool:
    """Whether any op has been recorded."""
    return comms_logger.has_data()


def get_comm_operation_count() -> int:
    """Recorded calls, over every op."""
    return comms_logger.get_total_operations()


def get_logged_comm_ops() -> list[str]:
    """Names of the recorded ops."""
    return comms_logger.get_operation_names()
