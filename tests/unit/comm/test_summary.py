"""``log_summary``'s table and dict, from records made without a process group."""

from __future__ import annotations

import re

from deepshard.comm import summary
from deepshard.comm.summary import log_summary, render, summary_dict


def fill(log):
    log.append("all_reduce", "all_reduce", 2.0, 1024, world=2)
    log.append("all_reduce", "all_reduce", 4.0, 1024, world=2)
    log.append("all_reduce", "all_reduce", 1.0, 4096, world=2)
    log.append("barrier", "barrier", 0.5, 0)


def test_table_lists_each_op_and_size_with_counts(restore_comms_logger, capsys):
    fill(restore_comms_logger)
    assert log_summary() is None
    lines = capsys.readouterr().out.splitlines()
    assert re.split(r"\s{2,}", lines[0]) == list(summary.COLUMNS)
    assert lines[1] == "all_reduce"
    assert re.split(r"\s{2,}", lines[2].strip())[:4] == ["1.0 KB", "2", "6.00", "3.00"]
    assert re.split(r"\s{2,}", lines[3].strip())[:3] == ["4.0 KB", "1", "1.00"]
    assert lines[4] == "barrier" and lines[5].split()[:2] == ["0B", "1"]


def test_dict_has_deepspeeds_layout(restore_comms_logger, capsys):
    fill(restore_comms_logger)
    result = log_summary(show_straggler=True, return_dict=True)
    assert set(result) == {"summary", "straggler_analysis", "metadata"}
    row = result["summary"]["all_reduce"][1024]
    assert set(row) == {"count", "total_latency_ms", "avg_latency_ms", "tput_avg_gbps",
                        "busbw_avg_gbps", "msg_size_bytes", "msg_size_str"}
    assert row["count"] == 2
    # one process: the fastest rank is this one, so nothing waited on a straggler
    straggler = result["straggler_analysis"]["all_reduce"][1024]
    assert straggler["total_comm_lat_ms"] == 6.0 and straggler["total_straggler_ms"] == 0.0
    assert result["metadata"]["world_size"] == 1 and result["metadata"]["rank"] == 0
    assert "Breakdown with straggler effect" in capsys.readouterr().out


def test_read_outs_and_reset(restore_comms_logger):
    from deepshard import comm

    fill(restore_comms_logger)
    assert comm.has_comm_data() and comm.get_comm_operation_count() == 4
    assert comm.get_logged_comm_ops() == ["all_reduce", "barrier"]
    comm.reset_log()
    assert not comm.has_comm_data()
    assert render(summary_dict()) == render(summary_dict())  # header only, stable
