"""An unchanged Accelerate training script with a DeepSpeed plugin: a tiny Llama, AdamW,
gradient accumulation 2 and clipping, ``accelerator.prepare``/``backward``/``step`` as
Accelerate's examples write them. Rank 0 writes its per-step losses and gradient norms
to ``<out_dir>/rank0.json``.

Run with a DeepSpeed (deepshard's, through ``ds-run --deepspeed_compat`` or ``ds-compat
install``; or DeepSpeed 0.19.8):

    ds-run --deepspeed_compat --num_gpus 2 accelerate_train.py --stage 3 --out_dir /tmp/a
    accelerate launch --config_file cfg.yaml accelerate_train.py --plugin none --out_dir ...

``--plugin code`` (default) builds ``DeepSpeedPlugin(zero_stage=..., ...)`` in the script;
``--plugin none`` leaves it to the environment ``accelerate launch`` sets from its config
file. ``--ddp`` trains without DeepSpeed (plain DDP: the reference).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo, for tests.*

MICRO, GAS, STEPS, LR, CLIP = 2, 2, 4, 1e-2, 0.5


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launchers pass it
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--plugin", choices=("code", "none"), default="code")
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--out_dir", required=True)
    args = p.parse_args()

    import transformers
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    from tests.integrations.scripts.hf_trainer_train import dataset
    from tests.integrations.tiny import tiny_config

    plugin = None
    if args.plugin == "code" and not args.ddp:
        plugin = DeepSpeedPlugin(zero_stage=args.stage, gradient_accumulation_steps=GAS,
                                 gradient_clipping=CLIP)
    # On a machine without GPUs Accelerate needs its process-group backend named, with
    # DeepSpeed 0.19.8 as with deepshard: without it, it counts one process (and cpu=True
    # turns DeepSpeed off)
    handlers = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=GAS,
                              kwargs_handlers=handlers)
    if accelerator.state.deepspeed_plugin is not None:
        accelerator.state.deepspeed_plugin.deepspeed_config[
            "train_micro_batch_size_per_gpu"] = MICRO
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    world = accelerator.num_processes
    data = dataset(MICRO * GAS * world * STEPS)
    # each rank its own contiguous slice of every global batch, as the reference cuts it
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms, micro = [], [], []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            accelerator.backward(loss)
            micro.append(loss.detach())
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                mean = accelerator.reduce(torch.stack(micro).mean(), reduction="mean")
                losses.append(mean.item())
                norms.append(float(norm) if norm is not None else
                             float(model.get_global_grad_norm()))
                micro.clear()
    if accelerator.is_main_process:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "rank0.json").write_text(json.dumps({
            "losses": losses, "grad_norms": norms, "world": world,
            "deepspeed": accelerator.state.deepspeed_plugin is not None,
            "engine": type(model).__module__ + "." + type(model).__name__,
            "rank": int(os.environ.get("RANK", "0"))}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
