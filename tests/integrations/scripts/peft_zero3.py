"""LoRA (peft) on a tiny HF Llama under deepshard engines, one variant after another in
one job; reports per-rank facts of each as ``RESULT <json>``.

argv: ``<out_dir> <variant> [<variant> ...]``, a variant being ``<stage>[:<mode>]`` with
the mode one of ``plain`` (default), ``recompute`` (HF gradient checkpointing,
``use_reentrant=False``), ``two-forwards`` (the halves of the micro-batch run forward
before one backward of their mean), ``retain`` (gradient accumulation 2: the second
micro-step runs backward again through the first one's graph, kept with ``retain_graph``),
``keep`` (``stage3_max_reuse_distance`` at DeepSpeed's default: units stay gathered from
forward to backward; the other modes set it to 0, releasing after each forward).
Every variant trains the same adapters on the same data, so all give the same losses;
each saves ``save_checkpoint(<out_dir>/<variant>, exclude_frozen_parameters=True)``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import deepshard
from tests.integrations.tiny import batch, tiny_config

STEPS = 3


def lora_model():
    import peft
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0)
    return peft.get_peft_model(model, lora)


def frozen_facts(module) -> dict:
    frozen = [p for p in module.parameters() if not p.requires_grad]
    held = sum(p.numel() * p.element_size() for p in frozen)
    groups = {id(p.ds_group): p.ds_group for p in frozen
              if getattr(p, "ds_group", None) is not None and p.numel() == 0}
    held += sum(g.spec.shard * g.dtype.itemsize for g in groups.values())
    return {"frozen": len(frozen), "frozen_whole": sum(p.numel() > 0 for p in frozen),
            "frozen_bytes_held": held,
            "frozen_bytes_full": sum((getattr(p, "ds_numel", None) or p.numel())
                                     * p.element_size() for p in frozen)}


def watch_frozen(groups) -> dict:
    """Record the most frozen groups gathered at once (each gather is wrapped)."""
    seen = {"groups": list(groups), "max": 0}

    def wrap(g):
        gather = g.gather

        def counted(*args, **kwargs):
            gather(*args, **kwargs)
            seen["max"] = max(seen["max"], sum(h.full is not None for h in groups))
        g.gather = counted

    for g in groups:
        wrap(g)
    return seen


def run(stage: int, mode: str, out: Path) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = lora_model()
    if mode == "recompute":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    gas = 2 if mode == "retain" else 1
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
              "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 0,
                                    # keep: DeepSpeed's default, the units stay gathered
                                    # from forward to backward (from the second step on)
                                    "stage3_max_reuse_distance":
                                        1_000_000_000 if mode == "keep" else 0}}
    engine, *_ = deepshard.initialize(model=model, model_parameters=[
        p for p in model.parameters() if p.requires_grad], config=config)
    facts = frozen_facts(engine.module)
    live = watch_frozen(engine.strategy.frozen_groups if stage == 3 else [])
    losses = []
    for step in range(STEPS):
        data = batch(n=2 * world, seed=step)
        mine = {k: v[rank::world] for k, v in data.items()}
        if mode == "two-forwards":
            first = engine(input_ids=mine["input_ids"][:1], labels=mine["labels"][:1]).loss
            second = engine(input_ids=mine["input_ids"][1:], labels=mine["labels"][1:]).loss
            loss = (first + second) / 2
            engine.backward(loss)
        elif mode == "retain":
            loss = engine(**mine).loss
            engine.backward(loss, retain_graph=True)
            engine.step()
            engine.backward(loss)
        else:
            loss = engine(**mine).loss
            engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    between = frozen_facts(engine.module)
    groups = live["groups"]
    engine(**mine)  # with grad and no backward: kept units stay gathered until emptied
    left = sum(g.full is not None for g in groups)
    engine.empty_partition_cache()
    emptied = sum(g.full is not None for g in groups)
    if mode == "recompute":  # generation runs without its cache under checkpointing
        engine.module.gradient_checkpointing_disable()
    prompt = batch(n=2, seq=6, seed=99)["input_ids"]
    with torch.no_grad():
        generated = engine.module.generate(input_ids=prompt, max_new_tokens=5, do_sample=False,
                                           pad_token_id=0, synced_gpus=stage == 3)
    engine.save_checkpoint(out / f"{stage}-{mode}", exclude_frozen_parameters=True)
    result = {"rank": rank, "stage": stage, "mode": mode, "losses": losses,
              "after_init": facts, "after_steps": between, "generated": generated.tolist(),
              "frozen_groups": len(live["groups"]), "max_frozen_live": live["max"],
              "gathered_without_backward": left, "gathered_after_emptying": emptied,
              "state_bytes": engine.state_bytes()}
    engine.destroy()
    return result


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out = Path(args[0])
    deepshard.init_distributed(verbose=False)
    for variant in args[1:]:
        stage, _, mode = variant.partition(":")
        print("RESULT " + json.dumps(run(int(stage), mode or "plain", out)), flush=True)


if __name__ == "__main__":
    main()
