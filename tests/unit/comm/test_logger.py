"""The comms logger's records and arithmetic: DeepSpeed's bandwidth formulas (with the
reduce-scatter correction), sizes, trimmed means, switches and raw layout."""

from __future__ import annotations

import pytest

from deepshard.comm.logger import CommsLogger, bandwidths, convert_size, trim_mean


@pytest.mark.parametrize(("op", "algbw", "busbw"), [
    # 1 MB in 1 ms on 4 ranks; bytes/ms * 8 / 1e6 = Gbps
    ("all_reduce", 2 * 8e6 / 1e6, 8e6 / 1e6 * 2 * 3 / 4),
    ("inference_all_reduce", 16.0, 12.0),
    ("all_gather_into_tensor", 4 * 8.0, 4 * 8.0 * 3 / 4),  # size is one rank's input
    ("reduce_scatter_tensor", 8.0, 8.0 * 3 / 4),  # size is the whole input already
    ("all_to_all_single", 8.0, 6.0),
    ("broadcast", 8.0, 8.0),
    ("send", 8.0, 8.0),
])
def test_bandwidths_follow_deepspeed_formulas(op, algbw, busbw):
    assert bandwidths(op, 10**6, 1.0, 4) == pytest.approx((algbw, busbw))


def test_zero_latency_and_sizes_render_as_deepspeed_does():
    assert bandwidths("all_reduce", 100, 0.0, 2) == (0.0, 0.0)
    assert [convert_size(n) for n in (0, 24, 1024, 1536, 3 * 1024**3)] == [
        "0B", "24.0 B", "1.0 KB", "1.5 KB", "3.0 GB"]


def test_trim_mean_drops_a_tenth_at_each_end():
    assert trim_mean([]) == 0.0
    assert trim_mean([5.0]) == 5.0
    assert trim_mean([100.0] + [1.0] * 8 + [-100.0]) == 1.0


def test_records_per_name_and_size_with_deepspeed_raw_layout():
    log = CommsLogger()
    log.append("all_reduce", "all_reduce", 2.0, 24, world=2)
    log.append("all_reduce", "all_reduce", 4.0, 24, world=2)
    log.append("all_reduce_coalesced", "all_reduce", 1.0, 44, world=2)
    log.append("barrier", "barrier", 0.5, 0)
    assert log.has_data() and log.get_operation_names() == ["all_reduce", "barrier"]
    assert log.get_total_operations() == 4
    raw = log.get_raw_data()
    assert raw["all_reduce"][24][:2] == [2, [2.0, 4.0]]  # each op's own latency
    summary = log.get_operation_summary("all_reduce")
    assert list(summary) == [24, 44]
    assert summary[24]["count"] == 2 and summary[24]["total_latency_ms"] == 6.0
    assert summary[24]["avg_latency_ms"] == 3.0 and summary[24]["msg_size_str"] == "24.0 B"
    assert log.get_operation_summary("broadcast") is None
    log.reset_data()
    assert not log.has_data()


def test_switches_and_filters():
    log = CommsLogger()
    assert (log.enabled, log.prof_all, log.verbose, log.debug, log.prof_ops) == (
        False, True, False, False, [])
    log.stop_profiling_comms()
    assert not log.should_profile("all_reduce", prof=False)
    assert log.should_profile("all_reduce", prof=True)
    log.start_profiling_op(["all_reduce", "broadcast"])
    assert log.should_profile("all_reduce", prof=False)
    log.stop_profiling_op(["all_reduce"])
    assert log.prof_ops == ["broadcast"]
    log.start_profiling_comms()
    assert log.should_profile("anything", prof=False)


def test_verbose_logs_each_op_on_rank_0_only(caplog):
    log = CommsLogger()
    log.verbose = True
    with caplog.at_level("INFO", logger="deepshard.comm"):
        log.append("all_reduce", "all_reduce", 1.0, 1024, world=2, rank=1)
        assert not caplog.records
        log.append("all_reduce", "all_reduce", 1.0, 1024, world=2, rank=0)
    assert "comm op: all_reduce | time (ms): 1.00 | msg size: 1.0 KB" in caplog.text
