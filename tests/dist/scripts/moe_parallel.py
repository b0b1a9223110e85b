"""MoE inside pipeline parallelism on 4 gloo ranks, against one process holding every
expert (:mod:`moe_common`): 2 stages x data 2, the MoE layer on stage 1, ZeRO stages 0-1
(the pipeline carries no aux loss, so the reference leaves it out). Reports ``RESULT
<json>``: per ZeRO stage, per step the largest weight difference on this rank, or the
one-line error ``initialize`` raised. MoE inside AutoTP: ``moe_tp.py``.

Usage: ``moe_parallel.py pp``.
"""

from __future__ import annotations

import dataclasses
import json

import moe_common as mc
import torch
import torch.distributed as dist

import deepshard
from deepshard.errors import UsageError

STEPS, EP = 2, 2
CASE = mc.Case(EP, 2, True, 1, "adam")


class MoEOnly(torch.nn.Module):
    """A pipeline layer: the MoE layer's output, its aux loss dropped."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe(x)[0]


def square_mean(out, _label):
    return out.pow(2).mean()


def run_pp(world: int) -> dict:
    """One pipeline run per ZeRO stage the pipeline takes (0, 1; 2 is refused)."""
    runs = {f"s{stage}": _run_pp(world, dataclasses.replace(CASE, stage=stage))
            for stage in (0, 1)}
    errors = [r["error"] for r in runs.values() if "error" in r]
    return {"error": errors[0]} if errors else {"stages": runs}


def _run_pp(world: int, case: mc.Case) -> dict:
    from deepshard.runtime.parallel.pipe_module import PipelineModule
    from deepshard.runtime.parallel.topology import Topology

    state = mc.reference_state(case)
    ref = mc.Reference(case, state)
    ref.net.forward = lambda x: ref.net.out(  # type: ignore[method-assign]
        ref.net.moe(torch.relu(ref.net.inp(x)))[0]).pow(2).mean()
    data = dist.get_rank() % 2  # rank = pipe * D + data
    net = mc.Net(EP, case.k, case.drop)
    net.load_state_dict(mc.to_local(state, EP, data))
    layers = [net.inp, torch.nn.ReLU(), MoEOnly(net.moe), net.out]
    model = PipelineModule(layers, topology=Topology.from_config(world, 2),
                           partition_method="uniform", loss_fn=square_mean)
    try:
        engine, *_ = deepshard.initialize(model=model, config=mc.config(case, world // 2))
    except UsageError as err:
        return {"error": str(err)}
    diffs = []
    for step in range(STEPS):
        xs = mc.batch(step, world // 2)
        engine.train_batch(iter([(xs[data], torch.zeros(1))]))
        ref.step(xs)
        diffs.append(_diff(_reference_names(engine.module), ref.state(), data))
    engine.destroy()
    return {"diffs": diffs, "compared": sorted(_reference_names(engine.module))}


def _reference_names(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This stage's state under the names of one process's ``Net`` (local expert ids)."""
    prefix = {"0": "inp.", "2": "", "3": "out."}  # layer 2 is MoEOnly: its own "moe."
    out = {}
    for name, p in module.state_dict().items():
        parts = name.split(".")
        cut = next(i for i, part in enumerate(parts) if part in prefix)
        out[prefix[parts[cut]] + ".".join(parts[cut + 1:])] = p
    return out


def _diff(local: dict, ref: dict, ep_rank: int) -> float:
    worst = 0.0
    for name, p in local.items():
        want = ref[mc.to_global(name, EP, ep_rank)]
        if want.shape != p.shape:
            return float("inf")  # a split tensor: not what one process holds
        worst = max(worst, float((p.float() - want).abs().max()))
    return worst


def main() -> None:
    deepshard.init_distributed()
    torch.set_num_threads(1)
    world = dist.get_world_size()
    out = run_pp(world)
    print("RESULT " + json.dumps({"rank": dist.get_rank(), **out}), flush=True)


if __name__ == "__main__":
    main()
