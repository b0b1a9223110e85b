"""``init_inference`` on 1, 2 and 4 gloo ranks against one process's dense HF model.

Tiny Llama, Qwen2 (grouped-query attention), GPT-2 (Conv1D, an odd vocabulary) and T5
(encoder-decoder, per-head position bias), built from configs and saved as HF directories;
each rank builds the model on the meta device and reads only its slices of the checkpoint
(``tests/dist/scripts/inference_probe.py``). Logits within fp32 1e-5, greedy, beam-search
and seeded-sampling tokens equal to the dense model's and the same on every rank, no split
parameter ever read whole; int8 tokens and perplexity reported against fp32; a ZeRO-3
training checkpoint served straight from its shard files.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, run_ds
from tests.inference_models import configs, save_models

PROBE = str(ROOT / "tests" / "dist" / "scripts" / "inference_probe.py")
FAMILIES = sorted(configs())
RUNS = {1: "families,int8", 2: "families,int8,inject,policy,pipeline,zero3",
        4: "families,policy"}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict[str, list[dict]]]:
    root = tmp_path_factory.mktemp("inference")
    save_models(root / "models")
    found: dict[int, dict[str, list[dict]]] = {}
    for world, checks in RUNS.items():
        result = run_ds("--num_gpus", str(world), PROBE, str(root / "models"), checks,
                        str(root / f"work{world}"), timeout=600)
        assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
        for line in result.stdout.splitlines():
            _, _, payload = line.partition(" RESULT ")
            if payload:
                data = json.loads(payload)
                found.setdefault(world, {}).setdefault(data["check"], []).append(data)
    return found


def _by_family(rows: list[dict], family: str) -> list[dict]:
    return [r for r in rows if r.get("family") == family]


@pytest.mark.parametrize("world", sorted(RUNS))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_rank_generates_the_dense_models_tokens(results, world, family):
    rows = _by_family(results[world]["families"], family)
    assert len(rows) == world
    for r in rows:
        assert r["max_logit_diff"] < 1e-5, r
        assert r["equal"] == {"greedy": True, "beam": True, "sample": True}, r
        assert all(r["same_on_all_ranks"].values()), r
        assert r["read_whole"] == [], r  # no rank read a split parameter whole
        if world > 1:
            assert set(r["heads"]) == {"heads"}, r  # attention split by heads, not gathered
            assert r["local_bytes"] < r["dense_bytes"] * (0.5 + 0.5 / world) + 2**16, r


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_int8_weights_keep_the_perplexity(results, world, family):
    for r in _by_family(results[world]["int8"], family):
        assert r["same_on_all_ranks"], r
        assert r["bytes_int8"] < 0.55 * r["bytes_fp32"], r
        assert abs(r["ppl_int8"] / r["ppl_fp32"] - 1) < 0.02, r
        assert r["top1_agreement"] >= 0.8, r  # random weights: near-uniform logits
        assert r["kernels"], r


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_kernel_injection_gives_the_same_tokens(results, family):
    rows = _by_family(results[2]["inject"], family)
    assert rows and all(r["equal"] and r["attention"] == "sdpa" for r in rows), rows


@pytest.mark.parametrize("world", [2, 4])
def test_a_block_autotp_cannot_split_is_refused_then_split_by_injection_policy(results, world):
    for r in results[world]["policy"]:
        assert "AutoTP has no rule to split Mixer" in r["refused"], r
        assert "injection_policy" in r["refused"], r
        assert r["kinds"] == ["column", "row"], r
        assert r["max_diff"] < 1e-5, r


def test_an_hf_pipeline_runs_on_the_engine(results):
    rows = results[2]["pipeline"]
    assert len(rows) == 2 and all(r["equal"] and r["engine"] == "InferenceEngine"
                                  for r in rows), rows


def test_a_zero3_training_checkpoint_is_served_from_its_shards(results):
    for r in results[2]["zero3"]:
        assert r["trained_moved"] > 1e-4, r  # the step changed the weights
        assert r["max_logit_diff"] < 1e-5, r
        assert r["read_whole"] == [], r
