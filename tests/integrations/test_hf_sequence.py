"""A tiny HF Llama/Qwen2 trained with Ulysses sequence parallelism 2 through
``UlyssesSPAttentionHF`` and the engine equals the same training without it (fp32, 1e-5):
SP 2 on 2 ranks (ZeRO 0 and 2; Qwen2 with 1 key/value head for 4 query heads) and SP 2 x
DP 2 on 4 ranks (ZeRO 3 and 1)."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "integrations" / "scripts" / "hf_sequence_train.py")


@pytest.mark.parametrize(("ranks", "cases"), [(2, ("llama:0", "qwen2:2")),
                                              (4, ("llama:3", "qwen2:1"))])
def test_hf_model_with_sequence_parallelism_trains_as_without(ranks, cases):
    result = run_ds("--num_gpus", str(ranks), SCRIPT, *cases, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == list(range(ranks))
    for _, r in reports.values():
        assert sorted(r["diffs"]) == sorted(cases)
        for case, diffs in r["diffs"].items():
            assert len(diffs) == 4 and max(diffs) < 1e-5, (case, diffs)
