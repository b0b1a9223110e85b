"""TRL's ``SFTTrainer`` or ``DPOTrainer`` on a tiny Llama and a word-level tokenizer built
in the script (no downloads), unchanged from how TRL's docs write them: the DeepSpeed
config goes in ``SFTConfig(deepspeed=...)``/``DPOConfig(deepspeed=...)``. Rank 0 writes
the logged per-step losses to ``<out_dir>/rank0.json``.

    ds-run --deepspeed_compat --num_gpus 2 trl_train.py --trainer sft --stage 3 --out_dir D
    ds-run --num_gpus 2 trl_train.py --trainer sft --ddp --out_dir D     # the reference

(DeepSpeed 0.19.8: ``torchrun --nproc_per_node 2`` in its venv.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo, for tests.*

WORDS = [f"t{i}" for i in range(120)]
SPECIAL = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]


def tokenizer():
    """A whitespace word-level tokenizer over ``WORDS`` (ids 4..123), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*SPECIAL, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   bos_token="[BOS]", eos_token="[EOS]")
    return fast


def text(g: torch.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g))


def sft_data(n: int):
    import datasets

    g = torch.Generator().manual_seed(7)
    return datasets.Dataset.from_dict({"text": [text(g, 12) for _ in range(n)]})


def dpo_data(n: int):
    import datasets

    g = torch.Generator().manual_seed(7)
    rows = [{"prompt": text(g, 6), "chosen": text(g, 5), "rejected": text(g, 5)}
            for _ in range(n)]
    return datasets.Dataset.from_list(rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--trainer", choices=("sft", "dpo"), default="sft")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out_dir", required=True)
    args = p.parse_args()

    import transformers
    import trl
    from transformers import TrainerCallback

    from tests.integrations.tiny import tiny_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro, gas = 2, 2
    config = None if args.ddp else {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": args.stage}}
    common = dict(output_dir=str(Path(args.out_dir) / "run"), per_device_train_batch_size=micro,
                  gradient_accumulation_steps=gas, max_steps=args.steps, learning_rate=1e-2,
                  logging_steps=1, report_to="none", save_strategy="no", seed=0,
                  max_grad_norm=0.5, deepspeed=config, disable_tqdm=True,
                  train_sampling_strategy="sequential", use_cpu=not torch.cuda.is_available())
    tok = tokenizer()
    cfg = tiny_config("llama", pad_token_id=0, bos_token_id=2, eos_token_id=3)
    n = micro * gas * world * args.steps
    # built before the config (which at ZeRO-3 would build it under zero.Init, drawing
    # its random weights in another order): the same weights at every stage and in DDP
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    torch.manual_seed(1)
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    if args.trainer == "sft":
        training = trl.SFTConfig(**common, max_length=16)
    else:
        training = trl.DPOConfig(**common, max_length=16, beta=0.1)
    history: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                history.append(dict(logs, step=state.global_step))

    if args.trainer == "sft":
        trainer = trl.SFTTrainer(model=model, args=training, train_dataset=sft_data(n),
                                 processing_class=tok, callbacks=[Record()])
    else:
        trainer = trl.DPOTrainer(model=model, ref_model=ref, args=training,
                                 train_dataset=dpo_data(n), processing_class=tok,
                                 callbacks=[Record()])
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "rank0.json").write_text(json.dumps({
            "losses": [h["loss"] for h in history],
            "grad_norms": [h.get("grad_norm") for h in history],
            "steps": [h["step"] for h in history]}))


if __name__ == "__main__":
    main()
