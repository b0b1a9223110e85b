"""MoE checkpoints that reshard across expert-parallel sizes (:mod:`moe_common`'s net: 4
experts, top-2, Adam), against one process holding every expert on the same global batches.

``moe_checkpoint.py first DIR`` (4 ranks): per chain (ZeRO stages), ``N`` steps at ep 2,
``save_checkpoint``; a fresh engine at ep 4 loads it, trains ``M`` steps, saves. Between
backward and step of each phase's last step it reads ``safe_get_full_*`` of its experts.
``moe_checkpoint.py second DIR`` (2 ranks, 2 micro-batches each): ep 1 loads the ep 4
checkpoint, trains ``K`` steps, saves; rank 0 also consolidates every saved checkpoint
(``get_fp32_state_dict_from_zero_checkpoint``, the ep 4 one also through the file
``convert_zero_checkpoint_to_fp32_state_dict`` writes). Each reports ``RESULT <json>``: per chain,
per-step loss and weight differences from the reference, the consolidated state dicts'
keys and differences, and the ``safe_get_full_*`` differences.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import moe_common as mc
import torch
import torch.distributed as dist

import deepshard
from deepshard.runtime.checkpoint.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
)
from deepshard.runtime.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
)

N, M, K, RANKS = 3, 2, 2, 4  # steps per phase; micro-batches per global batch
CHAINS = {"s2": (2, 1, 2), "s0": (0, 0, 0)}  # ZeRO stage at ep 2, ep 4, ep 1


def case(ep: int, stage: int) -> mc.Case:
    return mc.Case(ep, 2, True, stage, "adam")


class Reference(mc.Reference):
    """:class:`moe_common.Reference` that also keeps each micro-batch's loss."""

    def step(self, xs: torch.Tensor) -> None:  # one global batch, as moe_common's
        self.opt.zero_grad()
        losses = [self.net(x) for x in xs]
        self.losses = [float(v.detach()) for v in losses]
        (sum(losses) / len(xs)).backward()
        self.grads = {n: p.grad.clone() for n, p in self.net.named_parameters()}
        self.opt.step()


def reference(steps: int) -> tuple[Reference, list[dict], list[list[float]]]:
    """The reference after ``steps`` steps, its state after each and its losses."""
    ref = Reference(case(1, 0), mc.reference_state(case(1, 0)))
    states, losses = [], []
    for step in range(steps):
        ref.step(mc.batch(step, RANKS))
        states.append(ref.state())
        losses.append(ref.losses)
    return ref, states, losses


def engine_for(ep: int, stage: int, gas: int):
    net = mc.Net(ep, 2, True)  # weights come from the checkpoint (or moe_common's)
    if ep == 2:
        net.load_state_dict(mc.to_local(mc.reference_state(case(1, 0)), 2, mc.ep_rank_of(2)))
    cfg = mc.config(case(ep, stage), RANKS)
    cfg["gradient_accumulation_steps"] = gas
    engine, *_ = deepshard.initialize(model=net, config=cfg)
    return engine


def train(engine, ep: int, first: int, steps: int, gas: int, ref_states, ref_losses
          ) -> dict:
    """``steps`` global steps from step ``first``: loss and weight differences per step,
    and :func:`safe_get` before the last step's update."""
    rank = dist.get_rank()
    out: dict = {"loss": [], "weights": []}
    for step in range(first, first + steps):
        xs = mc.batch(step, RANKS)
        for j in range(gas):
            mb = rank * gas + j
            loss = engine(xs[mb])
            engine.backward(loss)
            out["loss"].append(abs(float(loss.detach()) - ref_losses[step][mb]))
            if step == first + steps - 1 and j == gas - 1:
                out["safe_get"] = safe_get(engine, step, ep)
            engine.step()  # every micro-batch: it applies at the boundary
        out["weights"].append(mc.max_diff(engine.module, ref_states[step], ep))
    return out


def safe_get(engine, step: int, ep: int) -> dict[str, float]:
    """Between backward and step ``step``: the largest difference of every expert
    parameter's ``safe_get_full_*`` value, gradient and Adam moments from the reference's
    (the weights and moments it starts the step with, the step's gradient)."""
    ref, states, _ = reference(step + 1)
    before = states[step - 1] if step else mc.reference_state(case(1, 0))
    moments = adam_moments(step)
    worst = {"param": 0.0, "grad": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    for name, p in engine.module.named_parameters():
        if ".deepspeed_experts." not in name:
            continue
        gname = mc.to_global(name, ep, mc.ep_rank_of(ep))
        got = {"param": safe_get_full_fp32_param(p), "grad": safe_get_full_grad(p),
               "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
               "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq")}
        want = {"param": before[gname], "grad": ref.grads[gname], **moments[gname]}
        for key in worst:
            worst[key] = max(worst[key], float((got[key].float() - want[key]).abs().max()))
    return worst


def adam_moments(steps: int) -> dict:
    """Each parameter's Adam moments after ``steps`` steps (by global name)."""
    ref = reference(steps)[0]
    names = {id(p): n for n, p in ref.net.named_parameters()}
    return {names[id(p)]: {k: s[k].clone() for k in ("exp_avg", "exp_avg_sq")}
            for p, s in ref.opt.state.items()}


def first(root: Path) -> dict:
    _, states, losses = reference(N + M)
    out = {}
    for chain, (s_a, s_b, _) in CHAINS.items():
        res: dict = {}
        engine = engine_for(2, s_a, 1)
        res["ep2"] = train(engine, 2, 0, N, 1, states, losses)
        engine.save_checkpoint(str(root / chain), tag="ep2")
        engine.destroy()
        engine = engine_for(4, s_b, 1)
        engine.load_checkpoint(str(root / chain), tag="ep2")
        res["ep4"] = train(engine, 4, N, M, 1, states, losses)
        engine.save_checkpoint(str(root / chain), tag="ep4")
        engine.destroy()
        out[chain] = res
    return out


def second(root: Path) -> dict:
    _, states, losses = reference(N + M + K)
    gas = RANKS // dist.get_world_size()
    out = {}
    for chain, (_, _, s_c) in CHAINS.items():
        engine = engine_for(1, s_c, gas)
        engine.load_checkpoint(str(root / chain), tag="ep4")
        res = {"ep1": train(engine, 1, N + M, K, gas, states, losses)}
        engine.save_checkpoint(str(root / chain), tag="ep1")
        engine.destroy()
        if dist.get_rank() == 0:
            res["consolidated"] = consolidated(root / chain, states)
        out[chain] = res
    return out


def consolidated(root: Path, states: list[dict]) -> dict:
    """Per tag: whether the consolidated keys are the reference's, in its order, and the
    largest value difference (tag ``ep4``: from the file ``zero_to_fp32`` writes)."""
    out = {}
    for tag, steps in (("ep2", N), ("ep4", N + M), ("ep1", N + M + K)):
        got = get_fp32_state_dict_from_zero_checkpoint(str(root), tag)
        if tag == "ep4":
            files = convert_zero_checkpoint_to_fp32_state_dict(root, root / "fp32", tag=tag)
            got = torch.load(files[0], weights_only=True)
        want = states[steps - 1]
        out[tag] = {"keys": list(got) == list(want), "got_keys": list(got),
                    "diff": max(float((got[k] - want[k]).abs().max()) for k in want
                                if k in got)}
    return out


def main() -> None:
    deepshard.init_distributed()
    torch.set_num_threads(1)
    phase, root = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    root = Path(root)
    out = first(root) if phase == "first" else second(root)
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "chains": out}), flush=True)


if __name__ == "__main__":
    main()
