"""Fine-tune a tiny Llama with the HF Trainer and an all-"auto" DeepSpeed config, through
deepshard (``--backend deepshard``: only the import changes) or DeepSpeed
(``--backend deepspeed``, in a venv that has it). Rank 0 writes what it logged per step to
``<out_dir>/rank0.json``: losses, grad norms, learning rates, eval loss, files saved.

deepshard:  ds-run --num_gpus 2 hf_trainer_train.py --stage 2 --out_dir /tmp/a
DeepSpeed:  DS_ACCELERATOR=cpu deepspeed --num_gpus 2 hf_trainer_train.py --backend deepspeed \
                --stage 2 --out_dir /tmp/b     (or torchrun --nproc_per_node 2 ...)

``--case "NAME ARGS..."`` (repeatable) runs several trainings in one job, one after another
(imports and process startup are most of a run's time): each parses ARGS over the command
line's and writes to ``<out_dir>/NAME/``; ``{out}`` in ARGS is ``<out_dir>``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo, for tests.*


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--backend", choices=("deepshard", "deepspeed"), default="deepshard")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--samples", type=int, default=0, help="dataset size (0: what --steps needs)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--config_optim", action="store_true",
                   help="AdamW + WarmupDecayLR sections in the config (all auto)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--best", action="store_true",
                   help="evaluate every --save_steps and load_best_model_at_end")
    p.add_argument("--auto_batch", action="store_true", help="auto_find_batch_size")
    p.add_argument("--lora", action="store_true", help="train a peft LoRA adapter")
    p.add_argument("--save_first", action="store_true", help="save_model() before train()")
    p.add_argument("--eval_first", action="store_true", help="evaluate() before train()")
    p.add_argument("--twice", action="store_true", help="train() again on the same Trainer")
    p.add_argument("--compile", default=None, metavar="BACKEND",
                   help="torch_compile=True with this torch_compile_backend")
    p.add_argument("--eval_only", action="store_true",
                   help="evaluate() without training (transformers' inference deepspeed_init)")
    p.add_argument("--save_steps", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--universal", action="store_true",
                   help='"checkpoint": {"load_universal": true} in the config')
    p.add_argument("--save_model", action="store_true")
    p.add_argument("--evaluate", action="store_true")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--case", action="append", default=[], help='"NAME ARGS..." (see above)')
    return p


def cases(argv: list[str]) -> list[argparse.Namespace]:
    """The runs the command line asks for: itself, or each ``--case`` over it."""
    p = parser()
    base = p.parse_args(argv)
    if not base.case:
        return [base]
    runs = []
    for case in base.case:
        name, *rest = shlex.split(case.replace("{out}", base.out_dir))
        run = p.parse_args([*argv, *rest])
        run.out_dir = str(Path(base.out_dir) / name)
        runs.append(run)
    return runs


def ds_config(args) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
        "zero_optimization": {"stage": args.stage, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"},
    }
    if args.universal:
        config["checkpoint"] = {"load_universal": True}
    if args.config_optim:
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
        config["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto"}}
    return config


def dataset(n: int, seq: int = 16, vocab: int = 128):
    """``n`` fixed samples (token ids are their labels)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return [{"input_ids": ids[i], "labels": ids[i].clone()} for i in range(n)]


def main() -> None:
    from tests.integrations.tiny import save_tiny

    runs = cases(sys.argv[1:])
    rank = int(os.environ.get("RANK", "0"))
    # every rank its own copy (no barrier needed), saved before any process group exists
    model_dir = save_tiny("llama", Path(parser().parse_args(sys.argv[1:]).out_dir)
                          / f"model_rank{rank}", seed=0)
    for args in runs:
        train(args, model_dir)


def train(args: argparse.Namespace, model_dir: Path) -> None:
    """One training run as the arguments say; rank 0 writes ``rank0.json``."""
    if args.backend == "deepspeed":
        from transformers import Trainer, TrainerCallback, TrainingArguments
    else:
        from transformers import TrainerCallback

        from deepshard.integrations.transformers import Trainer, TrainingArguments
    import transformers

    out = Path(args.out_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    training = TrainingArguments(
        output_dir=str(out / "run"), per_device_train_batch_size=args.micro,
        per_device_eval_batch_size=args.micro, gradient_accumulation_steps=args.gas,
        max_steps=args.steps, learning_rate=args.lr, warmup_steps=args.warmup,
        weight_decay=0.01, max_grad_norm=args.clip, logging_steps=1, report_to="none",
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        train_sampling_strategy="sequential", seed=0, deepspeed=ds_config(args),
        disable_tqdm=True, bf16=args.bf16, auto_find_batch_size=args.auto_batch,
        eval_strategy="steps" if args.best else "no", eval_steps=args.save_steps or None,
        load_best_model_at_end=args.best, use_cpu=not torch.cuda.is_available(),
        **({"torch_compile": True, "torch_compile_backend": args.compile} if args.compile
           else {}))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    if args.lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    n = args.samples or args.steps * args.gas * args.micro * world
    history: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            history.append(dict(logs or {}, step=state.global_step))

    trainer = Trainer(model=model, args=training, train_dataset=dataset(n),
                      eval_dataset=dataset(4 * world), callbacks=[Record()])
    if args.save_first:
        trainer.save_model(str(out / "saved_first"))
    first = trainer.evaluate()["eval_loss"] if args.eval_first or args.eval_only else None
    if not args.eval_only:
        trainer.train(resume_from_checkpoint=args.resume)
    if args.twice:
        trainer.train()
    result = {"losses": [x["loss"] for x in history if "loss" in x],
              "grad_norms": [x.get("grad_norm") for x in history if "loss" in x],
              "lrs": [x["learning_rate"] for x in history if "loss" in x],
              "steps": [x["step"] for x in history if "loss" in x]}
    if first is not None:
        result["eval_loss_before"] = first
    if args.compile:
        engine = trainer.model_wrapped
        # the whole model (stages 0-2), or each decoder layer's forward (stage 3)
        result["compiled"] = bool(getattr(engine, "is_compiled", False)) and (
            getattr(engine.module, "_compiled_call_impl", None) is not None
            or any(hasattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable")
                   for m in engine.module.modules()))
    if args.evaluate:
        result["eval_loss"] = trainer.evaluate()["eval_loss"]
    if args.save_model:
        trainer.save_model(str(out / "saved"))
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "rank0.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
