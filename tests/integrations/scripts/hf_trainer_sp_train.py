"""Fine-tune a tiny HF Llama with deepshard's ``Trainer`` and Ulysses sequence parallelism
2, against the same training in plain torch on one process; rank 0 writes
``<out_dir>/<case>.json`` (the Trainer's logged losses and gradient norms, and the
reference's).

Usage: ``ds-run --num_gpus N hf_trainer_sp_train.py --out_dir DIR CASE...``, each CASE
``name:stage:gas:how`` with ``how`` ``config`` (the DeepSpeed config's
``sequence_parallel_size: 2``) or ``hf`` (HF's ALST switch, ``TrainingArguments(
parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))``, the config's
key ``"auto"``). With N = 4 the groups are 2 data-parallel replicas of 2.

The samples are right-padded unevenly (``-100`` labels on the padding). The reference
follows the batches the SP loader adapter makes: at micro-step ``k`` sequence group ``d``
trains on the ``k // 2``-th batch of its rank ``2 d + k % 2``, whose sampler gives it global
batch ``(k // 2) * N + 2 d + k % 2`` (``train_sampling_strategy="sequential"``); each
optimizer step's loss is the token mean over every batch of its accumulation window (what
the Trainer computes without sequence parallelism), with AdamW, clipping and the linear
warmup schedule of the ``TrainingArguments``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo, for tests.*

SP, MICRO, STEPS, LR, WARMUP, CLIP, DECAY, SEQ = 2, 2, 4, 1e-2, 1, 0.5, 0.01, 16


def dataset(n: int, vocab: int = 128) -> list[dict]:
    """``n`` samples of ``SEQ`` tokens, the last 0-7 labels of each ``-100``."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (n, SEQ), generator=g)
    pads = torch.randint(0, 8, (n,), generator=g)
    samples = []
    for i in range(n):
        labels = ids[i].clone()
        labels[SEQ - int(pads[i]):] = -100
        samples.append({"input_ids": ids[i], "labels": labels})
    return samples


def step_samples(data: list[dict], step: int, gas: int, world: int) -> list[dict]:
    """The samples of optimizer step ``step`` under the SP loader adapter (module doc)."""
    out = []
    for k in range(step * gas, (step + 1) * gas):
        for d in range(world // SP):
            index = (k // SP) * world + SP * d + k % SP
            out.extend(data[index * MICRO:(index + 1) * MICRO])
    return out


def reference(model_dir: Path, data: list[dict], gas: int, world: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in named if n in decay], "weight_decay": DECAY},
         {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.999), eps=1e-8)
    sched = transformers.get_linear_schedule_with_warmup(opt, WARMUP, STEPS)
    losses, norms = [], []
    for step in range(STEPS):
        batch = step_samples(data, step, gas, world)
        ids = torch.stack([b["input_ids"] for b in batch])
        labels = torch.stack([b["labels"] for b in batch])
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten(),
                               ignore_index=-100, reduction="sum") / shifted.ne(-100).sum()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms}


def training_arguments(out: Path, stage: int, gas: int, how: str):
    from deepshard.integrations.transformers import TrainingArguments

    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_optimization": {"stage": stage},
              "sequence_parallel_size": SP if how == "config" else "auto"}
    extra = {}
    if how == "hf":
        from accelerate import ParallelismConfig
        from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

        extra["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed", sp_size=SP,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))
    return TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=gas, max_steps=STEPS, learning_rate=LR,
        warmup_steps=WARMUP, weight_decay=DECAY, max_grad_norm=CLIP, logging_steps=1,
        report_to="none", save_strategy="no", train_sampling_strategy="sequential", seed=0,
        deepspeed=config, disable_tqdm=True, use_cpu=not torch.cuda.is_available(), **extra)


def train(model_dir: Path, data: list[dict], out: Path, stage: int, gas: int, how: str
          ) -> dict:
    import transformers
    from transformers import TrainerCallback

    from deepshard.integrations.transformers import Trainer
    from deepshard.sequence.hf import unregister_from_transformers

    history: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            history.append(dict(logs or {}, step=state.global_step))

    args = training_arguments(out, stage, gas, how)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Record()])
    trainer.train()
    engine = trainer.deepspeed
    result = {"losses": [x["loss"] for x in history if "loss" in x],
              "grad_norms": [x["grad_norm"] for x in history if "loss" in x],
              "steps": [x["step"] for x in history if "loss" in x],
              "sp": engine.sequence_parallel_size, "dp": engine.dp_world_size,
              "train_batch_size": engine.train_batch_size()}
    engine.destroy()
    unregister_from_transformers("sdpa")
    return result


def main() -> None:
    from tests.integrations.tiny import save_tiny

    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out = Path(argv[argv.index("--out_dir") + 1])
    cases = [a for a in argv if a.count(":") == 3]
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny("llama", Path(tmp) / "m", seed=0)  # before any process group
        for case in cases:
            name, stage, gas, how = case.split(":")
            data = dataset(STEPS * int(gas) * MICRO * world // SP)
            # first: at ZeRO-3 the Trainer's arguments would load it partitioned
            want = reference(model_dir, data, int(gas), world) if rank == 0 else None
            got = train(model_dir, data, out / name, int(stage), int(gas), how)
            if rank == 0:
                (out / f"{name}.json").write_text(json.dumps({**got, "reference": want}))


if __name__ == "__main__":
    main()
