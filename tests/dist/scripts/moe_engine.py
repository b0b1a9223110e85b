"""MoE through the engine on N gloo ranks against one process holding every expert
(:mod:`moe_common`): for each case, 3 steps; reports ``RESULT <json>`` with, per case, the
largest weight difference after each step and the largest difference of the engine's
global gradient norm from the reference's.

Usage: ``moe_engine.py`` (the cases depend on the world size: 2 or 4 ranks).
"""

from __future__ import annotations

import json
import tempfile

import moe_common as mc
import torch
import torch.distributed as dist

import deepshard

STEPS = 3
C = mc.Case
CASES = {
    2: [C(2, 1, True, 0, "sgd"), C(2, 2, False, 0, "adam", clip=0.05),
        C(2, 2, True, 1, "adam"), C(2, 1, False, 2, "sgd", clip=0.05),
        C(1, 2, True, 2, "sgd"), C(2, 1, True, 0, "adamw1"), C(2, 2, True, 2, "sgd1")],
    4: [C(4, 2, True, 0, "adam"), C(2, 1, False, 0, "sgd", clip=0.05),
        C(4, 1, True, 1, "sgd"), C(2, 3, False, 1, "adam", clip=0.05),
        C(2, 2, True, 2, "sgd"), C(4, 2, False, 2, "adam", empty=True),
        C(1, 1, True, 1, "adam")],
}


def run(case: mc.Case, world: int) -> dict:
    state = mc.reference_state(case)
    ref = mc.Reference(case, state)
    net = mc.engine_model(case, state)
    engine, *_ = deepshard.initialize(model=net, optimizer=mc.client_optimizer(case, net),
                                      config=mc.config(case, world))
    diffs, norms, clipped = [], [], []
    for step in range(STEPS):
        xs = mc.batch(step, world)
        loss = engine(xs[dist.get_rank()])
        engine.backward(loss)
        engine.step()
        ref.step(xs)
        diffs.append(mc.max_diff(engine.module, ref.state(), case.ep))
        norms.append(abs(engine.get_global_grad_norm() - ref.norm) / ref.norm)
        clipped.append(bool(case.clip) and ref.norm > case.clip)
    engine.destroy()
    return {"diffs": diffs, "norms": norms, "clipped": clipped,
            "counts": ref.counts.tolist()}


def resume(case: mc.Case, world: int) -> dict:
    """A client optimizer with one mixed group: saved after 2 steps and resumed by a new
    engine, the third step gives the weights the first engine's third step gives."""
    state = mc.reference_state(case)
    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)

    def engine_of():
        net = mc.engine_model(case, state)
        return deepshard.initialize(model=net, optimizer=mc.client_optimizer(case, net),
                                    config=mc.config(case, world))[0]

    def train(engine, steps) -> None:
        for step in steps:
            engine.backward(engine(mc.batch(step, world)[dist.get_rank()]))
            engine.step()

    first = engine_of()
    train(first, range(2))
    first.save_checkpoint(where[0], tag="two")
    train(first, [2])
    want = {k: v.detach().clone() for k, v in first.module.state_dict().items()}
    first.destroy()
    second = engine_of()
    second.load_checkpoint(where[0], tag="two")
    train(second, [2])
    diff = max(float((v.float() - want[k].float()).abs().max())
               for k, v in second.module.state_dict().items())
    second.destroy()
    return {"diffs": [diff], "norms": [0.0], "clipped": [False], "counts": [1] * mc.E}


def main() -> None:
    deepshard.init_distributed()
    world = dist.get_world_size()
    torch.set_num_threads(1)
    out = {case.label: run(case, world) for case in CASES[world]}
    if world == 2:
        for case in (C(2, 1, True, 0, "adamw1"), C(2, 2, True, 2, "adamw1")):
            out[case.label + "-resume"] = resume(case, world)
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "cases": out}), flush=True)


if __name__ == "__main__":
    main()
