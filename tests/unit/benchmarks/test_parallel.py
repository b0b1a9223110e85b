"""benchmarks/parallel.py's bubble analysis (pure functions on fake results) and the split
of its "balanced" bubble-sweep model; nothing is timed here."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
import parallel as bench
from gpt import Block, GPTConfig
from gpt_pipe import GPTEmbedding, GPTHead, pipe_gpt

from deepshard.runtime.parallel.schedule import bubble_fraction


def outcome(timings: list[list[dict]], m: int = 4) -> bench.Outcome:
    """A 2-stage outcome: ``timings[rank]`` is that rank's per-step timing list."""
    spec = bench.RunSpec("pp2", 2, 2, 1, 2, m, "balanced", len(timings[0]), 0, "uniform")
    ranks = tuple({"rank": r, "coord": [r, 0, 0], "parts": [0, 4, 8], "step_s": [1.0],
                   "timing": t} for r, t in enumerate(timings))
    return bench.Outcome(spec, ranks)


def step(total: float, pipe: float, fwd: float, bwd: float) -> dict:
    return {"total_s": total, "pipe_s": pipe, "busy_s": fwd + bwd, "forward_s": fwd,
            "backward_s": bwd}


def test_the_span_is_the_pipelines_longest_schedule_on_every_stage():
    # the last stage's own pipe_s ends before the first stage's last backward
    o = outcome([[step(11.0, 10.0, 2.0, 6.0)], [step(11.0, 9.0, 2.0, 6.0)]])
    assert bench.stage_bubbles(o, "span") == pytest.approx([0.2, 0.2])
    assert bench.stage_bubbles(o, "pipe_s") == pytest.approx([0.2, 1 - 8.0 / 9.0])
    assert bench.stage_bubbles(o) == pytest.approx([1 - 8.0 / 11.0] * 2)


def test_span_is_taken_step_by_step_then_the_median():
    o = outcome([[step(5, 4.0, 1, 2), step(5, 6.0, 1, 2), step(5, 8.0, 1, 2)],
                 [step(5, 5.0, 1, 2), step(5, 3.0, 1, 2), step(5, 2.0, 1, 2)]])
    # spans 5, 6, 8: fractions 0.4, 0.5, 0.625 on both stages
    assert bench.stage_bubbles(o, "span") == pytest.approx([0.5, 0.5])


def test_no_span_without_pipe_timing():
    o = outcome([[{"total_s": 2.0, "busy_s": 1.0}], [{"total_s": 2.0, "busy_s": 1.0}]])
    assert bench.stage_bubbles(o, "span") is None
    assert bench.stage_bubbles(o) == pytest.approx([0.5, 0.5])


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_equal_measured_costs_simulate_to_the_theory(m):
    o = outcome([[step(9, 9, 2.0 * m, 4.0 * m)], [step(9, 9, 2.0 * m, 4.0 * m)]], m=m)
    costs = bench.stage_costs(o)
    assert [c for pair in costs for c in pair] == pytest.approx([2.0, 4.0, 2.0, 4.0])
    assert bench.simulated_bubbles(costs, m) == pytest.approx([bubble_fraction(2, m)] * 2)


def test_bubble_table_reports_the_stage_cost_ratio_and_the_gap_to_theory():
    o = outcome([[step(11.0, 10.0, 2.0, 6.0)], [step(11.0, 9.0, 2.0, 6.0)]], m=4)
    row = bench.bubble_table([o])[-1]
    assert "500+1500, 500+1500 (1.000)" in row
    assert "| 0.200 / 0.200 (+0% / +0%) |" in row  # over the span: theory exactly


def test_the_balanced_sweep_model_splits_into_embedding_plus_3_blocks_and_3_blocks_plus_head():
    cfg = GPTConfig(**{**bench.SIZES["balanced"], "d_model": 16, "n_head": 2, "seq_len": 8})
    stages = [pipe_gpt(cfg, 2, stage_id=s, partition_method="uniform") for s in range(2)]
    kinds = [[type(layer) for name, layer in stage.named_children() if name.isdigit()]
             for stage in stages]
    assert kinds == [[GPTEmbedding, Block, Block, Block], [Block, Block, Block, GPTHead]]
