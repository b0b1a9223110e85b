"""``deepshard.moe.hf``: HF transformers 5 sparse MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE)
with their experts sharded over the expert-parallel group, the HF router kept.

In one process (ep 1) the adapted model computes what the HF model computes, forward and
backward; on 2 gloo ranks (ep 2, ``scripts/hf_moe_train.py``) three Adam steps through
deepshard (ZeRO 0, 1, 2, gradient clipping) equal the unsharded HF model trained in one
process on both ranks' batches (1e-5: losses, load-balancing losses, router logits,
every parameter), the HF-format save loads with ``from_pretrained`` into a plain model
equal to that reference, and an engine checkpoint taken at ep 2 goes on at ep 1 (experts
and their Adam state found by global expert id) exactly as the reference does."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from deepshard.errors import UsageError
from deepshard.moe.hf import (
    HFExpertParallel,
    apply_expert_parallel,
    fused_state_dict,
    hf_state_dict,
    shard_hf_moe,
)
from deepshard.runtime.assembly.moe import global_names
from tests.helpers import ROOT, run_ds, tagged_json
from tests.integrations.scripts.hf_moe_train import VOCAB, tiny_moe
from tests.integrations.tiny import batch, tiny_config

SCRIPT = ROOT / "tests" / "integrations" / "scripts" / "hf_moe_train.py"
RUNS = ("mixtral:0:ep1", "qwen3_moe:2:ep1", "qwen2_moe:1:autoep")


def tiny(kind: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_moe(kind))


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_one_rank_computes_what_the_hf_model_computes(kind):
    ref = tiny(kind)
    model = copy.deepcopy(ref)
    assert shard_hf_moe(model, 1) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert isinstance(model.model.layers[0].mlp.experts, HFExpertParallel)
    data = batch(VOCAB, n=2, seq=8, seed=3)
    got, want = model(**data), ref(**data)
    for a, b in [(got.loss, want.loss), (got.aux_loss, want.aux_loss),
                 *zip(got.router_logits, want.router_logits, strict=True)]:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    got.loss.backward()
    want.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        if ".experts.experts." in name:
            layer, _, rest = name.partition(".experts.experts.")
            j, param = rest.split(".")
            want_grad = grads[f"{layer}.experts.{param}"][int(j)]
        else:
            want_grad = grads[name]
        torch.testing.assert_close(p.grad, want_grad, rtol=0, atol=1e-6, msg=name)
    reference = ref.state_dict()
    for state in (hf_state_dict(model), fused_state_dict(model.state_dict())):
        assert list(state) == list(reference)
        for key, value in reference.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)


def test_experts_are_named_by_global_id_and_marked():
    model = tiny("mixtral")
    shard_hf_moe(model, 1)
    name = "model.layers.1.mlp.experts.experts.1.down_proj"
    mine, every = global_names(model, name, ep_rank=1, ep_size=2)
    assert mine == "model.layers.1.mlp.experts.experts.5.down_proj"
    assert every == [f"model.layers.1.mlp.experts.experts.{g}.down_proj" for g in range(8)]
    param = model.get_parameter(name)
    assert param.allreduce is False and param.group_name == "ep_size_1"
    assert model.model.layers[0].mlp.gate.weight.shape == (4, 16)  # the router stays


def test_bad_input_is_one_line_with_a_hint():
    with pytest.raises(UsageError, match=r"no fused MoE experts module.*HINT"):
        shard_hf_moe(transformers.AutoModelForCausalLM.from_config(tiny_config("llama")), 1)
    with pytest.raises(UsageError, match="num_experts=4 is not divisible by ep_size=3"):
        shard_hf_moe(tiny("mixtral"), 3)
    with pytest.raises(UsageError, match="positive integer"):
        shard_hf_moe(tiny("mixtral"), 0)
    half = {"m.experts.experts.1.down_proj": torch.zeros(2, 2)}
    with pytest.raises(UsageError, match=r"m.experts.down_proj lacks experts \[0\]"):
        fused_state_dict(half)


def test_two_ranks_train_like_the_unsharded_model_and_save_hf_format(tmp_path):
    result = run_ds("--num_gpus", "2", str(SCRIPT), "--out_dir", str(tmp_path),
                    "--runs", *RUNS, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == [0, 1]
    for rank, (_, report) in reports.items():
        assert sorted(report["runs"]) == sorted(RUNS)
        for spec, run in report["runs"].items():
            assert run["local_experts"] == 2 and run["keys_equal"], (spec, run)
            for step in run["steps"] + run.get("resumed_steps", []):
                assert step["norm"] > 0.5, (spec, step)  # clipping acted
                assert max(step["loss"], step["aux"], step["router"]) < 1e-5, (spec, step)
            assert run["params"] < 1e-5, (spec, run)
            if spec.endswith(":ep1") and rank == 0:  # consolidated, experts fused back
                assert run["consolidated_keys_equal"], (spec, run)
                assert run["consolidated"] < 1e-5, (spec, run)
            if spec.endswith(":ep1"):  # the ep 2 checkpoint went on at ep 1, Adam state too
                assert len(run["resumed_steps"]) == 1, (spec, run)
                assert run["resumed"] == {"keys_equal": True, "params": run["resumed"]["params"]}
                assert run["resumed"]["params"] < 1e-5, (spec, run)
            if rank == 0:
                assert run["loaded_keys_equal"], (spec, run)
                assert max(run["loaded"], run["logits"]) < 1e-5, (spec, run)


def test_deepspeed_expert_parallel_section():
    model = tiny("qwen2_moe")
    fused = model.model.layers[0].mlp.experts.gate_up_proj
    assert apply_expert_parallel(model, {"enabled": False, "autoep_size": 2}) == {}
    assert model.model.layers[0].mlp.experts.gate_up_proj is fused
    mapped = apply_expert_parallel(model, {"enabled": True, "autoep_size": 1,
                                           "preset_model": "qwen3_moe"})
    experts = model.model.layers[0].mlp.experts.experts
    assert mapped[id(fused)] == [e.gate_up_proj for e in experts] and len(mapped) == 4
    for section, match in [({"enabled": True, "comm_backend": "deepep"},
                            "expert_parallel.comm_backend: .* not supported"),
                           ({"enabled": True, "autoep_size": "2"}, "autoep_size='2'"),
                           ({"enabled": True, "preset_model": "mixtral"}, "does not match")]:
        with pytest.raises(UsageError, match=match):
            apply_expert_parallel(tiny("qwen2_moe"), section)
