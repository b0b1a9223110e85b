"""A tiny HF Llama/Qwen2 trained with Ulysses sequence parallelism 2 through
``UlyssesSPAttentionHF`` and the engine equals the same training without it (fp32, 1e-5):
SP 2 on 2 ranks (ZeRO 0 and 2; Qwen2 with 1 key/value head for 4 query heads) and SP 2 x
DP 2 on 4 ranks (ZeRO 3 and 1). The 1-bit optimizers refuse sequence parallelism by its
key. (Through the Trainer: ``test_hf_trainer_sp.py``.)"""

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


def test_one_bit_optimizers_with_sequence_parallelism_name_the_key():
    from types import SimpleNamespace

    from deepshard.errors import UsageError
    from deepshard.runtime.api import _check_onebit
    from deepshard.runtime.parallel.topology import Topology

    layout = SimpleNamespace(topology=Topology(data=2, sequence=2))
    with pytest.raises(UsageError, match="OneBitAdam with sequence_parallel_size 2 is not "):
        _check_onebit("OneBitAdam", 0, layout, "ds.json")
    with pytest.raises(UsageError, match="ZeroOneAdam with sequence_parallel_size 4 "):
        _check_onebit("ZeroOneAdam", 0, None, "ds.json", sequence=4)  # groups from mpu=
    _check_onebit("OneBitAdam", 1, None, "ds.json")  # plain data parallelism: accepted
