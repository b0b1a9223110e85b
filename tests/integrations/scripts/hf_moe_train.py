"""Train tiny HF MoE models with their experts sharded over the ranks
(``deepshard.moe.hf.shard_hf_moe``, ep = world size) and, beside them in the same process,
the unsharded model with torch's Adam on every rank's batch; save in the HF format.

    ds-run --num_gpus 2 hf_moe_train.py --out_dir OUT --runs mixtral:0 qwen3_moe:2

A run is ``kind:stage[:ep1][:autoep]`` (``ep1``: then checkpoint, load the checkpoint at
ep 1 and take one more step; ``autoep``: ``initialize`` shards the model itself, by
DeepSpeed's ``expert_parallel`` config section, from parameters listed before).
Every rank prints ``RESULT {json}``: per step the largest
difference of its loss, load-balancing loss and router logits from the reference's on its
batch, and after the steps that of every parameter (experts gathered back under HF
names); rank 0 adds that of the state dict ``from_pretrained`` loads from the save, and
of its logits.
"""

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import deepshard
from deepshard.moe.hf import expert_parallel_layers, fused_state_dict, hf_state_dict, shard_hf_moe
from tests.integrations.tiny import batch

VOCAB = 64
STEPS = 3
# eps well above the gradients' rounding: with eps 1e-8, Adam's first step is lr * sign(g)
# and an entry whose gradient cancels to ~1e-8 moves by lr either way
LR, BETAS, EPS = 1e-2, [0.9, 0.99], 1e-4
CLIP = 0.5  # below the gradient norm: the norm must count every expert once


def tiny_moe(kind: str):
    common = {"vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
              "max_position_embeddings": 32, "output_router_logits": True,
              "router_aux_loss_coef": 0.1, "tie_word_embeddings": False}
    if kind == "mixtral":
        return transformers.MixtralConfig(intermediate_size=24, num_local_experts=4,
                                          num_experts_per_tok=2, **common)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=24, moe_intermediate_size=12,
                                           num_experts=4, num_experts_per_tok=2,
                                           norm_topk_prob=True, **common)
    return transformers.Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=12,
                                       shared_expert_intermediate_size=20, num_experts=4,
                                       num_experts_per_tok=2, **common)


def biggest(a, b) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def make_engine(model, stage: int, autoep: int = 0):
    """The engine; ``autoep``: DeepSpeed's AutoEP section at that size shards the model."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": LR, "betas": BETAS, "eps": EPS,
                                                      "weight_decay": 0.0}},
              "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}}
    if autoep:
        config["expert_parallel"] = {"enabled": True, "autoep_size": autoep}
    # listed now: with autoep they are the fused HF parameters initialize replaces
    params = list(model.parameters())
    engine, _, _, _ = deepshard.initialize(model=model, model_parameters=params,
                                           config=config)
    return engine


def train(engine, ref, ref_opt, steps: range) -> list[dict]:
    """Steps of the engine and of the reference (every rank's batch, the mean loss)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for step in steps:
        batches = [batch(VOCAB, n=2, seq=8, seed=100 * step + r) for r in range(world)]
        got = engine(**batches[rank])
        engine.backward(got.loss)
        engine.step()
        ref_opt.zero_grad()
        want = [ref(**b) for b in batches]
        (sum(w.loss for w in want) / world).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
        ref_opt.step()
        mine = want[rank]
        out.append({"norm": norm, "loss": biggest(got.loss, mine.loss),
                    "aux": biggest(got.aux_loss, mine.aux_loss),
                    "router": max(biggest(a, b) for a, b in
                                  zip(got.router_logits, mine.router_logits, strict=True))})
    return out


def compared(engine, ref) -> dict:
    state, reference = hf_state_dict(engine.module), ref.state_dict()
    return {"keys_equal": list(state) == list(reference),
            "params": max(biggest(state[k], v) for k, v in reference.items())}


def loaded(path: Path, ref) -> dict:
    """The HF-format save loaded into a plain model, against the reference."""
    plain = transformers.AutoModelForCausalLM.from_pretrained(path)
    state, reference = plain.state_dict(), ref.state_dict()
    ids = batch(VOCAB, n=2, seq=8, seed=7)["input_ids"]
    with torch.no_grad():
        logits = biggest(plain(input_ids=ids).logits, ref(input_ids=ids).logits)
    return {"loaded_keys_equal": list(state) == list(reference),
            "loaded": max(biggest(state[k], v) for k, v in reference.items()),
            "logits": logits}


def run(kind: str, stage: int, flags: list[str], out: Path) -> dict:
    """Train at ep = world size; save in the HF format; with ``reshard``, checkpoint, load
    the checkpoint into a model sharded at ep 1 (from other weights) and take one step."""
    start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe(kind))
    ref = copy.deepcopy(model)
    reshard = "ep1" in flags
    if "autoep" in flags:
        engine = make_engine(model, stage, autoep=world)
        replaced = [name for name, _ in expert_parallel_layers(model)]
    else:
        replaced = shard_hf_moe(model, ep_size=world)
        engine = make_engine(model, stage)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR, betas=BETAS, eps=EPS)
    report = {"rank": rank, "kind": kind, "stage": stage, "replaced": replaced,
              "steps": train(engine, ref, ref_opt, range(STEPS)), **compared(engine, ref),
              "local_experts": len(model.get_submodule(replaced[0]).experts)}
    engine.save_pretrained(out / "model")  # the engine's HF save gathers the experts
    if rank == 0:
        report.update(loaded(out / "model", ref))
    if reshard:
        engine.save_checkpoint(str(out / "ckpt"))
        engine.destroy()
        dist.barrier()
        if rank == 0:  # every expert consolidated from the rank files, fused back
            state = fused_state_dict(deepshard.get_fp32_state_dict(out / "ckpt"))
            report["consolidated_keys_equal"] = list(state) == list(ref.state_dict())
            report["consolidated"] = max(biggest(state[k], v)
                                         for k, v in ref.state_dict().items())
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(tiny_moe(kind))
        shard_hf_moe(model, ep_size=1)
        engine = make_engine(model, stage)
        engine.load_checkpoint(str(out / "ckpt"))
        report["resumed_steps"] = train(engine, ref, ref_opt, range(STEPS, STEPS + 1))
        report["resumed"] = compared(engine, ref)
    engine.destroy()
    report["seconds"] = time.perf_counter() - start
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--runs", nargs="+", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepshard.init_distributed()
    reports = {}
    for spec in args.runs:
        kind, stage, *rest = spec.split(":")
        reports[spec] = run(kind, int(stage), rest,
                            Path(args.out_dir) / spec.replace(":", "_"))
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "runs": reports}), flush=True)


if __name__ == "__main__":
    main()
