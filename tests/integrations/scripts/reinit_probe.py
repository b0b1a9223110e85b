"""One HF model through several engines in turn (stages 3, 3, 2, 3): each ``initialize``
takes the weights the previous engine (destroyed) left partitioned; reports the largest
logit difference from the model before any engine as ``RESULT <json>``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import deepshard
from tests.integrations.tiny import batch, tiny_config


def main() -> None:
    import transformers

    deepshard.init_distributed(verbose=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    with torch.no_grad():
        want = model(**batch(n=2)).logits
    diffs = []
    for stage in (3, 3, 2, 3):
        config = {"train_micro_batch_size_per_gpu": 2,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        with torch.no_grad():
            diffs.append(float((engine(**batch(n=2)).logits - want).abs().max()))
        engine.destroy()
    print("RESULT " + json.dumps({"rank": torch.distributed.get_rank(), "diffs": diffs}),
          flush=True)


if __name__ == "__main__":
    main()
