"""Tensor-parallel layers, the vocabulary-parallel loss and AutoTP on real gloo groups
started by ds-run, against the dense modules (see ``scripts/tp_probe.py``).

One job per world size runs every check: each layer (forward, input and weight
gradients), the loss with and without ignored targets, and AutoTP on examples/gpt.py's GPT
and on GPT-2-, LLaMA- and Phi-3-like models (loss, every gradient, the gathered state dict,
three training steps); over the whole world as the tensor-parallel group and, on 4 ranks,
over two groups of 2 as well.
"""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, run_ds, tagged_json

PROBE = str(ROOT / "tests" / "dist" / "scripts" / "tp_probe.py")
TOLERANCE = 5e-6
"""Largest difference relative to the reference's largest magnitude (fp32, sums in
another order)."""


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_dense(world):
    result = run_ds("--num_gpus", str(world), PROBE, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    tagged = tagged_json(result.stdout, "RESULT")
    assert sorted(tagged) == list(range(world))
    expected_groups = {"world": world} | ({"pairs": 2} if world == 4 else {})
    for rank, (_, data) in tagged.items():
        assert {k: g["size"] for k, g in data["groups"].items()} == expected_groups
        for label, group in data["groups"].items():
            assert group["tp_rank"] == (rank if label == "world" else rank % 2)
            errors = group["errors"]
            assert len(errors) >= 30
            bad = {k: v for k, v in errors.items() if not v <= TOLERANCE}
            assert not bad, f"rank {rank}, group {label}: {bad}"
            facts = group["facts"]
            # examples/gpt.py's Block reshapes with its input's full width: attention is
            # gathered; the others follow their head-count attributes
            assert facts["gpt attention"] == ["gather"]
            for model in ("head-gpt", "gpt2-like", "llama-like", "llama-like fused"):
                assert facts[f"{model} attention"] == ["heads"], model
            assert all(v for k, v in facts.items() if not k.endswith("attention")), facts
