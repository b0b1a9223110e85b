"""MoE through the engine on N gloo ranks against one process holding every expert
(:mod:`moe_common`): for each case, 3 steps; reports ``RESULT <json>`` with, per case, the
largest weight difference after each step and the largest difference of the engine's
global gradient norm from the reference's.

Usage: ``moe_engine.py`` (the cases depend on the world size: 2 or 4 ranks).
"""

from __future__ import annotations

import json

import moe_common as mc
import torch
import torch.distributed as dist

import deepshard

STEPS = 3
C = mc.Case
CASES = {
    2: [C(2, 1, True, 0, "sgd"), C(2, 2, False, 0, "adam", clip=0.05),
        C(2, 2, True, 1, "adam"), C(2, 1, False, 2, "sgd", clip=0.05),
        C(1, 2, True, 2, "sgd")],
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


def main() -> None:
    deepshard.init_distributed()
    world = dist.get_world_size()
    torch.set_num_threads(1)
    out = {case.label: run(case, world) for case in CASES[world]}
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "cases": out}), flush=True)


if __name__ == "__main__":
    main()
