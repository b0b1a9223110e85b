"""The comms logger: per-op records of latency, message size and bandwidth.

DeepSpeed's API makes the logger process-wide (``deepspeed.comm.configure(...)``,
``deepspeed.comm.log_summary()``), so there is one :class:`CommsLogger`, :data:`comms_logger`,
the only mutable state of :mod:`deepshard.comm`. It holds the settings of the
``comms_logger`` config section and, per (log name, message size), the count and the
latency and bandwidth of every recorded op. Bandwidths follow DeepSpeed's
``calc_bw_log`` (after nccl-tests' algorithmic and bus bandwidth), in Gbps, latencies in ms.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from deepshard.comm.config import CommsLoggerConfig

logger = logging.getLogger("deepshard.comm")

# ops by the bandwidth formula that applies to them
_ALL_REDUCE = ("all_reduce", "all_reduce_coalesced", "inference_all_reduce")
_GATHER = ("all_gather", "all_gather_into_tensor", "all_gather_coalesced")
_SCATTER = ("reduce_scatter", "reduce_scatter_tensor")
_ALL_TO_ALL = ("all_to_all", "all_to_all_single")


def bandwidths(op: str, size: int, latency_ms: float, world: int) -> tuple[float, float]:
    """(algorithmic, bus) bandwidth in Gbps of ``op`` moving ``size`` bytes in
    ``latency_ms`` over ``world`` ranks, as DeepSpeed computes them, with one correction:
    ``size`` of a reduce-scatter is already its whole input, so it is not multiplied by
    the world size again (DeepSpeed's figure for it is ``world`` times too high)."""
    if latency_ms <= 0:
        return 0.0, 0.0
    n = max(world, 1)
    if op in _ALL_REDUCE:
        algbw, busbw = 2 * size / latency_ms, size / latency_ms * 2 * (n - 1) / n
    elif op in _GATHER:
        algbw = size * n / latency_ms  # ``size`` is one rank's input; n inputs arrive
        busbw = algbw * (n - 1) / n
    elif op in _SCATTER or op in _ALL_TO_ALL:
        algbw = size / latency_ms
        busbw = algbw * (n - 1) / n
    else:  # point-to-point, broadcast, reduce, gather, scatter, barrier
        algbw = busbw = size / latency_ms
    # bytes/ms -> Gbit/s
    return algbw * 8 / 1e6, busbw * 8 / 1e6


def convert_size(size_bytes: int) -> str:
    """``1.0 KB``, ``2.5 MB``... (DeepSpeed's rendering of message sizes)."""
    if size_bytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    i = min(math.floor(math.log(size_bytes, 1024)), len(names) - 1)
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def trim_mean(data: Iterable[float], trim_percent: float = 0.1) -> float:
    """Mean of ``data`` without the lowest and highest ``trim_percent`` (DeepSpeed's)."""
    values = sorted(data)
    n = len(values)
    if n == 0:
        return 0.0
    k = round(n * trim_percent)
    kept = values[k:n - k] or values
    return sum(kept) / len(kept)


@dataclass
class OpRecord:
    """Every recorded call of one op name with one message size."""

    op: str
    """The op's own name (``all_reduce``), which decides the bandwidth formula."""
    latencies_ms: list[float] = field(default_factory=list)
    algbw_gbps: list[float] = field(default_factory=list)
    busbw_gbps: list[float] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.latencies_ms)


class CommsLogger:
    """Settings of the ``comms_logger`` section and the records it collected.

    Attribute names are DeepSpeed's (``enabled``, ``verbose``, ``prof_all``, ``debug``,
    ``prof_ops``; ``start_profiling_comms()``...), so code that pokes DeepSpeed's
    ``deepspeed.comm.comms_logger`` works on this one.
    """

    def __init__(self) -> None:
        defaults = CommsLoggerConfig()
        self.enabled = defaults.enabled
        self.verbose = defaults.verbose
        self.prof_all = defaults.prof_all
        self.debug = defaults.debug
        self.prof_ops: list[str] = list(defaults.prof_ops)
        self.comms_dict: dict[str, dict[int, OpRecord]] = {}

    def configure(self, config: CommsLoggerConfig) -> None:
        """Take every setting of a validated ``comms_logger`` section."""
        self.enabled, self.verbose = config.enabled, config.verbose
        self.prof_all, self.debug = config.prof_all, config.debug
        self.prof_ops = list(config.prof_ops)

    def should_profile(self, log_name: str, prof: bool) -> bool:
        """Whether a call logged as ``log_name`` is recorded (the logger being enabled)."""
        return prof or self.prof_all or log_name in self.prof_ops

    # DeepSpeed's switches: all ops, or ops by name
    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: Iterable[str]) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: Iterable[str]) -> None:
        stop = set(op_name_list)
        self.prof_ops = [op for op in self.prof_ops if op not in stop]

    def append(self, raw_name: str, record_name: str, latency_ms: float, msg_size: int,
               world: int = 1, rank: int = 0) -> None:
        """Record one call of ``raw_name`` logged as ``record_name`` in a group of ``world``
        ranks (``verbose``: logged when ``rank`` is 0)."""
        algbw, busbw = bandwidths(raw_name, msg_size, latency_ms, world)
        record = self.comms_dict.setdefault(record_name, {}).setdefault(
            msg_size, OpRecord(raw_name))
        record.latencies_ms.append(latency_ms)
        record.algbw_gbps.append(algbw)
        record.busbw_gbps.append(busbw)
        if self.verbose and rank == 0:
            logger.info("comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | "
                        "busbw (Gbps): %.2f", record_name, latency_ms, convert_size(msg_size),
                        algbw, busbw)

    # ---- reading the records ------------------------------------------------------------

    def has_data(self) -> bool:
        return bool(self.comms_dict)

    def reset_data(self) -> None:
        self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(r.count for sizes in self.comms_dict.values() for r in sizes.values())

    def get_raw_data(self) -> dict[str, dict[int, list[object]]]:
        """DeepSpeed's raw layout: ``{name: {size: [count, [ms], [algbw], [busbw]]}}``."""
        return {name: {size: [r.count, list(r.latencies_ms), list(r.algbw_gbps),
                              list(r.busbw_gbps)] for size, r in sizes.items()}
                for name, sizes in self.comms_dict.items()}

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, object]] | None:
        """Per message size: count, total and trimmed-mean latency and bandwidths."""
        sizes = self.comms_dict.get(operation_name)
        if sizes is None:
            return None
        return {size: summarise(size, sizes[size]) for size in sorted(sizes)}


def summarise(size: int, record: OpRecord) -> dict[str, object]:
    """One row of the summary, with DeepSpeed's keys."""
    return {
        "count": record.count,
        "total_latency_ms": sum(record.latencies_ms),
        "avg_latency_ms": trim_mean(record.latencies_ms),
        "tput_avg_gbps": trim_mean(record.algbw_gbps),
        "busbw_avg_gbps": trim_mean(record.busbw_gbps),
        "msg_size_bytes": size,
        "msg_size_str": convert_size(size),
    }


comms_logger = CommsLogger()
"""The process's comms logger (see the module docstring)."""
