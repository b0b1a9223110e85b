"""DeepSpeed-layout and universal checkpoints into a tensor-parallel job: reports per rank
as ``RESULT <json>``.

``tp_checkpoint_resume.py <scratch dir>``: every rank trains the tiny GPT of
``tests/tp_models`` (fp32, AdamW, ZeRO-1) data parallel for 2 steps and saves in
DeepSpeed's layout (``checkpoint.format: "deepspeed"``); rank 0 converts that to a
universal folder; the job trains 3 more steps and records the whole weights after each.
Then, for each of the two checkpoints, a job whose AutoTP splits the model over 2
tensor-parallel ranks (data parallel over the rest) loads it (the universal one with
``checkpoint.load_universal``), and reports which parameters AutoTP sliced, the largest
difference of its gathered weights from the run's at the save and after each of the same
3 steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import deepshard  # noqa: E402
from deepshard.runtime.parallel.tensor import gather_full_state_dict, tp_layout  # noqa: E402
from tests.tp_models import GPT, GPTConfig  # noqa: E402

TINY = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=64)
GLOBAL_BATCH = 8
SAVE_AT, CONTINUE = 2, 3


def config(tp: int = 1, universal: bool = False, deepspeed_layout: bool = False) -> dict:
    cfg = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01,
                                                     "torch_adam": True}},
           "zero_optimization": {"stage": 1}, "steps_per_print": 1000}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if deepspeed_layout:
        cfg["checkpoint"] = {"format": "deepspeed"}
    return cfg


def step(engine, at: int, rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(500 + at)
    tokens = torch.randint(0, TINY.vocab_size, (GLOBAL_BATCH, TINY.seq_len + 1), generator=g)
    per = GLOBAL_BATCH // world
    mine = tokens[rank * per:(rank + 1) * per]
    engine.backward(engine(mine[:, :-1], mine[:, 1:]))
    engine.step()


def weights(engine, tp_group=None) -> dict[str, torch.Tensor]:
    names = {n for n, _ in engine.module.named_parameters()}
    if tp_group is None:
        state = engine.module.state_dict()
    else:
        state = gather_full_state_dict(engine.module, tp_group)
    return {n: v.detach().float().clone() for n, v in state.items() if n in names}


def diff(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def main() -> None:
    from deepshard.runtime.checkpoint.universal import convert

    scratch = Path(next(a for a in sys.argv[1:] if not a.startswith("--local_rank")))
    deepshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(deepspeed_layout=True))
    for at in range(SAVE_AT):
        step(engine, at, rank, world)
    engine.save_checkpoint(str(scratch / "ckpt"))
    want = [weights(engine)]
    for at in range(SAVE_AT, SAVE_AT + CONTINUE):
        step(engine, at, rank, world)
        want.append(weights(engine))
    engine.destroy()
    if rank == 0:
        convert(scratch / "ckpt" / f"global_step{SAVE_AT}",
                scratch / "universal" / f"global_step{SAVE_AT}_universal")
    dist.barrier()
    results = {}
    for kind, where in (("deepspeed", scratch / "ckpt"), ("universal", scratch / "universal")):
        torch.manual_seed(1)  # other initial values: the load must set them
        model = GPT(TINY)
        engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                          config=config(2, universal=kind == "universal"))
        group = engine.mpu.get_tensor_model_parallel_group()
        dp_rank, dp_world = engine.mpu.get_data_parallel_rank(), engine.dp_world_size
        engine.load_checkpoint(str(where))
        out = {"sliced": sorted(tp_layout(engine.module)), "global_steps": engine.global_steps,
               "diffs": [diff(weights(engine, group), want[0])]}
        for i, at in enumerate(range(SAVE_AT, SAVE_AT + CONTINUE)):
            step(engine, at, dp_rank, dp_world)
            out["diffs"].append(diff(weights(engine, group), want[i + 1]))
        engine.destroy()
        results[kind] = out
    print("RESULT " + json.dumps({"rank": rank, "results": results}), flush=True)


if __name__ == "__main__":
    main()
