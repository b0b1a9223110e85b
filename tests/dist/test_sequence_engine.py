"""``sequence_parallel_size`` through the engine (``scripts/sequence_engine.py``): 2
replicas x 2 sequence ranks on 4 gloo ranks train a grouped-query transformer at ZeRO
stages 0-3 exactly as plain torch trains it on the replicas' whole batches; the batch
triad counts replicas, and the engine's loader gives a sequence group one share."""

from __future__ import annotations

from deepshard.config import parse_config
from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "sequence_engine.py")


def test_sequence_parallel_is_a_config_key():
    loaded = parse_config({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2})
    assert loaded.config.sequence_parallel_size == 2
    assert "sequence_parallel_size" not in loaded.unimplemented


def test_sp2_x_dp2_at_every_zero_stage_equals_plain_training():
    result = run_ds("--num_gpus", "4", SCRIPT, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == [0, 1, 2, 3]
    for _, r in reports.values():
        for stage, run in r["stages"].items():
            assert len(run["diffs"]) == 4 and max(run["diffs"]) < 1e-5, (stage, run)
            # DeepSpeed's triad: micro 2 x accumulation 1 x (4 ranks / sp 2) replicas
            assert run["train_batch_size"] == 4 and run["dp_world_size"] == 4
            assert run["len"] == 4  # the adapter: 2 batches per rank x 2 sequence ranks
    samples = [reports[rank][1]["stages"]["0"]["samples"] for rank in range(4)]
    assert samples[0] == samples[1] and samples[2] == samples[3]
    assert sorted(samples[0] + samples[2]) == list(range(8))
