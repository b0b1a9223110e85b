"""MoE checkpoints that reshard across expert-parallel sizes (:mod:`moe_common`'s net: 4
experts, top-2, Adam), against one process holding every expert on the same global batches.

``moe_checkpoint.py first DIR`` (4 ranks): per chain (ZeRO stages), ``N`` steps at ep 2,
``save_checkpoint``; a fresh engine at ep 4 loads it, trains ``M`` steps, saves. Between
backward and step of the last ep 4 step it reads ``safe_get_full_*`` of its experts.
``moe_checkpoint.py second DIR`` (2 ranks, 2 micro-batches each): ep 1 loads the ep 4
checkpoint, trains ``K`` steps, saves; rank 0 also consolidates every saved checkpoint
(``get_fp32_state_dict_from_zero_checkpoint``). Each reports ``RESULT <json>``: per chain,
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
from deepshard.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
)
from deepshard.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

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


def train(engine, ep: int, first: int, steps: int, gas: int, ref_states, ref_losses,
          probe=None) -> dict:
    """``steps`` global steps from step ``first``; loss and weight differences per step."""
    rank = dist.get_rank()
    loss_diffs, weight_diffs = [], []
    for step in range(first, first + steps):
        xs = mc.batch(step, RANKS)
        for j in range(gas):
            mb = rank * gas + j
            loss = engine(xs[mb])
            engine.backward(loss)
            loss_diffs.append(abs(float(loss.detach()) - ref_losses[step][mb]))
            if probe is not None and step == first + steps - 1 and j == gas - 1:
                probe(engine, step)
            engine.step()  # every micro-batch: it applies at the boundary
        weight_diffs.append(mc.max_diff(engine.module, ref_states[step], ep))
    return {"loss": loss_diffs, "weights": weight_diffs}


def safe_get_probe(out: dict, ref_grads: dict, ref_adam: dict, ep: int):
    """Reads every expert parameter's full fp32 value, gradient and Adam state between
    backward and step; stores the largest difference from the reference's."""

    def probe(engine, step: int) -> None:
        worst = {"param": 0.0, "grad": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
        before = reference(step)[1][step - 1]  # the weights this step starts from
        for name, p in engine.module.named_parameters():
            if ".deepspeed_experts." not in name:
                continue
            gname = mc.to_global(name, ep, mc.ep_rank_of(ep))
            got = {"param": safe_get_full_fp32_param(p), "grad": safe_get_full_grad(p),
                   "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
                   "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq")}
            want = {"param": before[gname], "grad": ref_grads[gname],
                    **ref_adam[gname]}
            for key in worst:
                worst[key] = max(worst[key], float((got[key].float() - want[key]).abs().max()))
        out["safe_get"] = worst

    return probe


def adam_state_before(step: int) -> dict:
    """Each parameter's Adam moments after ``step`` steps (by global name)."""
    ref = reference(step)[0]
    names = {id(p): n for n, p in ref.net.named_parameters()}
    return {names[id(p)]: {k: s[k].clone() for k in ("exp_avg", "exp_avg_sq")}
            for p, s in ref.opt.state.items()}


def first(root: Path) -> dict:
    ref, states, losses = reference(N + M)
    out = {}
    for chain, (s_a, s_b, _) in CHAINS.items():
        res: dict = {}
        engine = engine_for(2, s_a, 1)
        res["ep2"] = train(engine, 2, 0, N, 1, states, losses)
        engine.save_checkpoint(str(root / chain), tag="ep2")
        engine.destroy()
        engine = engine_for(4, s_b, 1)
        engine.load_checkpoint(str(root / chain), tag="ep2")
        last = N + M - 1
        grads = {n: g for n, g in ref.grads.items()}  # the reference's last step's
        probe = safe_get_probe(res, grads, adam_state_before(last), 4)
        res["ep4"] = train(engine, 4, N, M, 1, states, losses, probe)
        engine.save_checkpoint(str(root / chain), tag="ep4")
        engine.destroy()
        out[chain] = res
    return out


def second(root: Path) -> dict:
    _, states, losses = reference(N + M + K)
    out = {}
    for chain, (_, _, s_c) in CHAINS.items():
        engine = engine_for(1, s_c, RANKS // dist.get_world_size())
        engine.load_checkpoint(str(root / chain), tag="ep4")
        res = {"ep1": train(engine, 1, N + M, K, RANKS // dist.get_world_size(), states,
                            losses)}
        engine.save_checkpoint(str(root / chain), tag="ep1")
        engine.destroy()
        if dist.get_rank() == 0:
            res["consolidated"] = consolidated(root / chain, states)
        out[chain] = res
    return out


def consolidated(root: Path, states: list[dict]) -> dict:
    """Per tag: whether the consolidated keys are the reference's, in its order, and the
    largest value difference."""
    out = {}
    for tag, steps in (("ep2", N), ("ep4", N + M), ("ep1", N + M + K)):
        got = get_fp32_state_dict_from_zero_checkpoint(str(root), tag)
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
