"""benchmarks/inference.py's pure parts (the plan, the carried failures, the rows read back
from the ranks' result files) and inference_report.py's ratios and target verdicts, on
made-up rows; nothing is launched or timed here."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import inference as bench
import inference_report as report


def row(peer: str, tp: int, dtype: str, batch: int, tokens_per_s: float, rss: float,
        perplexity: float = 100.0, **extra) -> dict:
    runtime = peer.split("-")[0]
    return {"peer": peer, "runtime": runtime, "tp": tp, "dtype": dtype, "batch": batch,
            "tokens": 128, "status": "ok", "first_token_ms": 50.0, "tokens_per_s": tokens_per_s,
            "wall_s": [1.0, 1.1], "peak_rss_mib": [rss] * tp, "tokens_equal_hf": True,
            "first_difference": None, "ranks_agree": True, "agreement": 1.0,
            "perplexity": perplexity, "streamed": 129, "load_s": 1.0,
            "threads_per_rank": 2 // tp, **extra}


def not_run(peer: str, tp: int, dtype: str, batch: int, status: str) -> dict:
    return {"peer": peer, "runtime": peer.split("-")[0], "tp": tp, "dtype": dtype,
            "batch": batch, "status": status}


def test_the_plan_is_every_setup_of_every_peer_at_every_batch():
    specs = bench.plan(["hf", "deepshard"], (1, 8))
    assert specs[:3] == [bench.RunSpec("hf", 1, "fp32", 1), bench.RunSpec("hf", 1, "fp32", 8),
                         bench.RunSpec("deepshard", 1, "fp32", 1)]
    assert len(specs) == 2 + 4 * 2
    assert {(s.tp, s.dtype) for s in specs if s.peer == "deepshard"} == {
        (1, "fp32"), (2, "fp32"), (1, "int8"), (2, "int8")}


@pytest.mark.parametrize("cores, tp, want", [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 2, 8)])
def test_the_ranks_of_a_launch_share_the_cores(cores, tp, want):
    assert bench.threads(cores, tp) == want


@pytest.mark.parametrize("ours, want", [
    ([[1, 2, 3], [4, 5, 6]], None),
    ([[1, 2, 3], [4, 9, 6]], 1),
    ([[1, 2], [4, 5, 6]], 2),  # one sequence came back short
    ([[1, 2, 9], [4, 9, 6]], 1),  # the earliest over the batch
])
def test_the_first_difference_is_the_first_position_any_sequence_differs(ours, want):
    assert bench.first_difference(ours, [[1, 2, 3], [4, 5, 6]]) == want


def test_a_refusal_at_init_repeats_at_every_batch_and_a_failure_is_not_retried():
    failed = {("deepspeed", 2, "fp32"): (1, "not runnable: AssertionError: AutoTP"),
              ("deepshard", 1, "int8"): (1, "failed: TypeError: boom")}
    assert bench.carried_status(bench.RunSpec("deepspeed", 2, "fp32", 8), failed) \
        == "not runnable: AssertionError: AutoTP"
    assert bench.carried_status(bench.RunSpec("deepshard", 1, "int8", 8), failed) \
        == "skipped: it failed at batch 1: failed: TypeError: boom"
    assert bench.carried_status(bench.RunSpec("deepshard", 2, "int8", 8), failed) is None


def rank_result(rank: int, first_difference=None, **extra) -> dict:
    return {"rank": rank, "status": "ok", "first_token_s": [0.05, 0.07], "wall_s": [2.0, 4.0],
            "peak_rss_kib": (500 + rank) * 1024, "first_difference": first_difference,
            "agreement": 1.0, "perplexity": 99.0, "scored_tokens": 128, "streamed": 129,
            "load_s": 1.5, "threads": 1, "layers": {}, "torch": "2.13", "transformers": "5.23",
            **extra}


def test_the_row_is_rank_0s_medians_and_every_ranks_rss(tmp_path):
    setup = bench.Setup(model=bench.QUICK_MODEL, tokens=128, batches=(8,), repeats=2, cores=2)
    got = bench.collect([rank_result(1, first_difference=3), rank_result(0)], 0,
                        tmp_path / "log", bench.RunSpec("deepshard", 2, "fp32", 8), setup)
    assert got["status"] == "ok"
    assert got["tokens_per_s"] == pytest.approx(8 * 128 / 3.0)
    assert got["first_token_ms"] == pytest.approx(60.0)
    assert got["peak_rss_mib"] == [500.0, 501.0]
    assert got["tokens_equal_hf"] and not got["ranks_agree"]


def test_a_rank_that_reported_a_failure_names_it_and_one_that_did_not_report_is_read_from_the_log(
        tmp_path):
    spec, setup = bench.RunSpec("deepshard", 2, "int8", 1), bench.Setup(
        model=bench.QUICK_MODEL, tokens=8, batches=(1,), repeats=1, cores=2)
    bad = {"rank": 1, "status": "failed: TypeError: no kernel"}
    assert bench.collect([rank_result(0), bad], 1, tmp_path / "log", spec, setup)["status"] \
        == "failed: TypeError: no kernel (rank 1)"
    log = tmp_path / "launch.log"
    log.write_text("[localhost:1] Traceback ...\n[localhost:1] RuntimeError: gloo hung up\n"
                   "ds-run: last 2 line(s) of rank 1:\n")
    assert bench.collect([rank_result(0)], 1, log, spec, setup)["status"] \
        == "failed: exit 1, 1 of 2 rank results: RuntimeError: gloo hung up"


def rows_for_targets() -> list[dict]:
    rows = []
    for b in (1, 8):
        rows += [row("hf", 1, "fp32", b, 10.0 * b, 1000.0),
                 row("deepspeed", 1, "fp32", b, 11.0 * b, 1050.0),
                 not_run("deepspeed", 2, "fp32", b, "not runnable: AssertionError: AutoTP"),
                 row("deepshard", 2, "fp32", b, 24.0 * b, 550.0 if b == 1 else 700.0),
                 row("deepshard", 2, "int8", b, 36.0 * b, 400.0, perplexity=101.0)]
    return report.add_ratios(rows)


def test_the_ratios_compare_int8_with_its_fp32_and_deepshard_with_hf():
    int8 = next(r for r in rows_for_targets() if r["dtype"] == "int8" and r["batch"] == 1)
    assert int8["speed_vs_fp32"] == pytest.approx(1.5)
    assert int8["perplexity_vs_fp32"] == pytest.approx(1.01)
    assert int8["rss_vs_hf"] == pytest.approx(0.4)
    assert int8["vs_deepspeed"] is None  # DeepSpeed's tp 2 did not run


def test_the_targets_say_met_missed_or_not_measured_with_why():
    lines = report.targets(rows_for_targets())
    assert lines[0] == ("target batch 1: deepshard tp 2 tokens/s >= 1.2x DeepSpeed tp 2: not "
                        "measured (deepspeed tp 2 fp32 batch 1: not runnable: AssertionError: "
                        "AutoTP)")
    assert lines[1] == "  context batch 1: deepshard tp 2 / DeepSpeed tp 1 tokens/s = 2.18x"
    assert lines[2].endswith("550 MiB vs 1000 MiB = 0.55x, met")
    assert lines[3] == ("target batch 1: deepshard tp 2 int8 tokens/s >= 1.3x fp32: 1.50x, met")
    assert lines[4].endswith("101.00 vs 100.00 (+1.00%), met")
    assert "700 MiB vs 1000 MiB = 0.70x, MISSED" in lines[7]


def test_the_table_gives_a_row_that_did_not_run_its_reason_and_a_divergence_its_position():
    rows = rows_for_targets()
    rows[0] = {**rows[0], "tokens_equal_hf": False, "first_difference": 17}
    rows[2] = {**rows[2], "status": "failed: a | b"}
    lines = report.table(rows)
    assert "| no (from token 17) |" in lines[2]
    assert lines[4].endswith("| - | - | - | - | - | - | failed: a \\| b |")
    assert "(1.0100x fp32)" in lines[6]


def test_an_unknown_peer_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--only", "hf,vllm"])
    assert exc.value.code == 2
    assert "unknown peer 'vllm'" in capsys.readouterr().err
