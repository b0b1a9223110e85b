"""Loads DeepSpeed 0.19.8's pipeline and MoE checkpoints (``tests/data/deepspeed_checkpoints``
``pipe2_zero1``, ``moe_ep2_zero2``) into deepshard jobs of several layouts and continues
them; reports per rank as ``RESULT <json>``.

``ds_parallel_resume.py <job> [<job> ...]``, a job being ``<case>:<size>:<zero>``: for
``pipe2_zero1``, a ``PipelineModule`` of the same layers over ``<size>`` stages, data
parallel over the remaining ranks (``0`` stages: an ``nn.Sequential`` of them, data
parallel); for ``moe_ep2_zero2`` / ``moe_ep2_zero0``, the same MoE model at ``ep_size``
``<size>``; ``<zero>``: the ZeRO stage. ``:noopt`` after it loads with
``load_optimizer_states=False``; ``:universal`` loads, instead of the checkpoint, a
universal folder made from it (a plain data-parallel job of the same layers loads it,
saves with deepshard, and rank 0 converts that with ``ds_to_universal``: the names are
the layers' indices, the pipeline's too) with ``checkpoint.load_universal``; its folders
go under ``--scratch DIR``. Each job loads the checkpoint, compares this rank's
fp32 weights with DeepSpeed's at the save, then (unless ``:noopt``: its optimizer starts
afresh, so it would not continue as DeepSpeed did) trains the 3 global batches DeepSpeed
trained after its save and compares after each step. Experts are compared under their
global ids.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data" / "deepspeed_checkpoints"
sys.path.insert(0, str(DATA))

import ds_fixture_model as fm  # noqa: E402

import deepshard  # noqa: E402
from deepshard.runtime.tensor_fragment import safe_get_full_fp32_param  # noqa: E402

EXPERTS = ".deepspeed_experts."


def fp32_weights(engine, ep: int = 1) -> dict[str, torch.Tensor]:
    """This rank's parameters' full fp32 values, experts under their global names."""
    local = fm.EXPERTS // ep
    out = {}
    for name, p in engine.module.named_parameters():
        if EXPERTS in name:
            head, tail = name.split(EXPERTS)
            i, rest = tail.split(".", 1)
            name = f"{head}{EXPERTS}{dist.get_rank() % ep * local + int(i)}.{rest}"
        out[name] = safe_get_full_fp32_param(p).float().cpu()
    return out


def diff(got: dict, want: dict) -> float:
    assert set(got) <= set(want), sorted(set(got) - set(want))
    return max(float((got[k] - want[k]).abs().max()) for k in got)


def _pipe_engine(stages: int, zero: int, universal: bool = False):
    """The pipeline fixture's model as a job of ``stages`` stages (0: plain data
    parallel) and a function training one global batch."""
    from deepshard.runtime.parallel.pipe_module import PipelineModule
    from deepshard.runtime.parallel.topology import Topology

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(123)  # other initial values than DeepSpeed's: the load must set them
    cfg = fm.config(zero, False)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if not stages:
        model = torch.nn.Sequential(*fm.pipe_layers())
        engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                          config=cfg)
        return engine, lambda step: fm.train_step(engine, step, rank, world)
    topology = Topology.from_config(world, stages)
    dp = world // stages
    cfg["train_micro_batch_size_per_gpu"] = fm.PIPE_MICRO
    cfg["gradient_accumulation_steps"] = fm.GLOBAL_BATCH // (fm.PIPE_MICRO * dp)
    model = PipelineModule(fm.pipe_layers(), topology=topology,
                           loss_fn=torch.nn.functional.mse_loss,
                           partition_method="parameters")
    engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    data = topology.coord(rank).data
    return engine, lambda step: engine.train_batch(iter(fm.pipe_batches(step, data, dp)))


def _moe_engine(ep: int, zero: int):
    from deepshard.moe.layer import MoE

    rank, world = dist.get_rank(), dist.get_world_size()
    model = fm.moe_model(MoE, ep, rank % ep)
    engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=fm.config(zero, False))
    return engine, lambda step: fm.moe_train_step(engine, step, rank, world)


def _universal(case: str, zero: int, scratch: Path) -> Path:
    """``case`` loaded by a plain data-parallel job, saved with deepshard and converted
    to universal on rank 0: the save directory holding ``latest_universal``."""
    from deepshard.runtime.checkpoint.universal import convert

    root = scratch / f"{case}-{zero}"
    engine, _ = _pipe_engine(0, zero)
    engine.load_checkpoint(str(DATA / case / "ckpt"))
    engine.save_checkpoint(str(root / "deepshard"), client_state={"epoch": 3})
    engine.destroy()
    if dist.get_rank() == 0:
        convert(root / "deepshard" / "global_step2", root / "global_step2_universal")
    dist.barrier()
    return root


def run(job: str, scratch: Path | None) -> dict:
    case, size, zero, *flags = job.split(":")
    expected = torch.load(DATA / case / "expected.pt", weights_only=False)
    source = DATA / case / "ckpt"
    if "universal" in flags:
        if scratch is None:
            raise SystemExit("a universal job needs --scratch DIR")
        source = _universal(case, int(zero), scratch)
    if case.startswith("pipe"):
        engine, step = _pipe_engine(int(size), int(zero), "universal" in flags)
        ep = 1
    else:
        engine, step = _moe_engine(int(size), int(zero))
        ep = int(size)
    load_optimizer = "noopt" not in flags
    path, client = engine.load_checkpoint(str(source), load_optimizer_states=load_optimizer)
    weights = fp32_weights(engine, ep)
    out = {"path": Path(path).name.removesuffix("_universal"), "epoch": client.get("epoch"),
           "global_steps": engine.global_steps, "names": sorted(weights),
           "at_save": diff(weights, expected["at_save"]), "after": [], "lrs": [],
           "want_lrs": expected["lrs"]}
    for i, s in enumerate(range(fm.SAVE_AT, fm.SAVE_AT + fm.CONTINUE) if load_optimizer
                          else ()):
        step(s)
        out["after"].append(diff(fp32_weights(engine, ep), expected["after"][i]))
        out["lrs"].append(engine.get_lr()[0])
    engine.destroy()
    return out


def main() -> None:
    deepshard.init_distributed()
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    scratch = None
    if "--scratch" in args:
        at = args.index("--scratch")
        scratch = Path(args[at + 1])
        del args[at:at + 2]
    results = {job: run(job, scratch) for job in args}
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "results": results}), flush=True)


if __name__ == "__main__":
    main()
