"""At ZeRO-3 through transformers' own DeepSpeed path (``ds-run --deepspeed_compat``):
``from_pretrained`` loads into shards, ``resize_token_embeddings`` grows the vocabulary,
a ``Trainer`` trains two steps, and ``generate(synced_gpus=True)`` decodes prompts of a
different length on each rank. Each rank writes what it saw to ``<out_dir>/rank<r>.json``; with
``--plain`` the same in one process without DeepSpeed (the reference).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo, for tests.*

NEW_VOCAB = 136


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--out_dir", required=True)
    args = p.parse_args()

    import transformers
    from transformers.integrations import is_deepspeed_zero3_enabled

    from tests.integrations.scripts.hf_trainer_train import dataset
    from tests.integrations.tiny import save_tiny

    rank = int(os.environ.get("RANK", "0"))
    world = 1 if args.plain else int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(args.out_dir)
    model_dir = save_tiny("llama", out / f"model_rank{rank}", seed=0)
    config = None if args.plain else {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": 3}}
    training = transformers.TrainingArguments(
        output_dir=str(out / "run"), per_device_train_batch_size=4 // world, max_steps=2,
        learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no", seed=0,
        max_grad_norm=0.5, train_sampling_strategy="sequential", deepspeed=config,
        disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    loaded_partitioned = model.model.embed_tokens.weight.numel() == 0
    # what deepshard's sliced reader read on this rank (0 when transformers' own ZeRO-3
    # path read the checkpoint: every tensor whole)
    read = getattr(model, "_deepshard_bytes_read", 0)
    model.resize_token_embeddings(NEW_VOCAB, mean_resizing=False)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset(8))
    trainer.train()
    losses = [x["loss"] for x in trainer.state.log_history if "loss" in x]
    # rank 0 decodes a 3-token prompt, rank 1 a 5-token one: ranks finish at other times
    model = trainer.model_wrapped.module if not args.plain else trainer.model
    model.eval()
    prompts = {r: dataset(2)[r]["input_ids"][:3 + 2 * r] for r in range(2)}
    generated = {}
    for r in (range(2) if args.plain else [rank]):
        with torch.no_grad():
            ids = model.generate(prompts[r][None], max_new_tokens=4, do_sample=False,
                                 synced_gpus=not args.plain, pad_token_id=0)
        generated[r] = ids[0].tolist()
    weight = model.get_input_embeddings().weight
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "zero3": is_deepspeed_zero3_enabled(), "partitioned": loaded_partitioned,
        "vocab": (weight.ds_shape if hasattr(weight, "ds_shape") else weight.shape)[0],
        "losses": losses, "generated": generated, "bytes_read": read,
        "checkpoint_bytes": (model_dir / "model.safetensors").stat().st_size}))


if __name__ == "__main__":
    main()
