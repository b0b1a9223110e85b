"""Train tiny HF models with deepshard for two steps and save them with
``deepshard.integrations.hf_save.save_pretrained``, one run after another in one job.

    ds-run --num_gpus 2 hf_save_train.py --out_dir OUT --runs llama:3 gpt2:3:bf16 peft:0

A run is ``kind:stage[:bf16]`` (kind ``llama``, ``gpt2``, or ``peft``: LoRA on the tiny
Llama). Each saves into ``OUT/<run>/model``; every rank lists the weights files it wrote
in ``OUT/<run>/written_rank<r>.json``; rank 0 saves ``OUT/<run>/expected.pt``: the
parameters gathered independently of the writer, what ``consolidated_16bit_state_dict``
returned, and the engine's logits on a fixed batch.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import deepshard
from deepshard.integrations import hf_save
from deepshard.integrations.hf_save import consolidated_16bit_state_dict, save_pretrained
from tests.integrations.tiny import batch, tiny_config


def build(kind: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config("llama" if kind == "peft" else kind))
    if kind == "peft":
        import peft

        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                               lora_dropout=0.0)
        model = peft.get_peft_model(model, lora)
    return model


def run(kind: str, stage: int, bf16: bool, out: Path) -> None:
    model = build(kind)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "bf16": {"enabled": bf16},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepshard.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config)
    rank = dist.get_rank()
    for step in range(2):
        loss = engine(**batch(n=2, seed=10 * step + rank)).loss
        engine.backward(loss)
        engine.step()
    if stage == 3:
        assert any(p.numel() == 0 for p in model.parameters()), "nothing partitioned"
    written: list[str] = []
    write_file = hf_save._write_file
    hf_save._write_file = lambda m, state, path, *rest: (
        written.append(path.name), write_file(m, state, path, *rest))[1]
    save_pretrained(engine, out / "model", max_shard_size="20KB")
    hf_save._write_file = write_file
    (out / f"written_rank{rank}.json").write_text(json.dumps(written))
    consolidated = consolidated_16bit_state_dict(engine)
    params = [p for _, p in model.named_parameters()]
    with deepshard.zero.GatheredParameters(params):
        gathered = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.eval()
    ids = batch(n=2, seed=99)["input_ids"]
    with torch.no_grad():
        logits = engine(input_ids=ids).logits.float()
    if rank == 0:
        torch.save({"gathered": gathered, "consolidated": consolidated, "logits": logits,
                    "input_ids": ids}, out / "expected.pt")
    else:
        assert consolidated == {}, "only rank 0 gets the consolidated state dict"
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--runs", nargs="+", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    for spec in args.runs:
        kind, stage, *rest = spec.split(":")
        run(kind, int(stage), rest == ["bf16"], Path(args.out_dir) / spec.replace(":", "_"))
    print("HF_SAVE_DONE", flush=True)


if __name__ == "__main__":
    main()
