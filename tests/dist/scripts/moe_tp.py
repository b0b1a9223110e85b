"""MoE layers inside AutoTP on 4 gloo ranks (tensor 2 x data 2, rank = data * 2 + tensor),
against one process holding every expert, on the same global batches.

The net: a Linear in, one block (an MLP AutoTP splits, ``fc`` column- and ``proj``
row-parallel, then an MoE layer of 4 experts, ep 2 over the data axis, top-2, which AutoTP
leaves whole: replicated over the tensor group), a Linear out. Per case (ZeRO 0, 1, 2;
with and without a gradient clipping that clips), ``STEPS`` steps of Adam. The clipped
ZeRO 1 case then saves a checkpoint, a fresh engine (from the initial weights) loads it
and takes one more step; rank 0 consolidates the checkpoint. Tensor rank 1 starts from
other weights and data rank 1 from other dense ones: initialize broadcasts rank 0's.

Reports ``RESULT <json>``: the names AutoTP split, and per case per step the largest
difference of this rank's parameters (its shards of the split ones) from the reference's,
the engine's gradient norm and the reference's (before clipping).

Usage: ``moe_tp.py DIR`` (the checkpoint directory).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import moe_common as mc
import torch
import torch.distributed as dist

import deepshard
from deepshard.moe.layer import MoE
from deepshard.runtime.parallel.tensor import tp_layout
from deepshard.runtime.parallel.tp_shards import shard_tensor

T, EP, STEPS, CLIP = 2, 2, 3, 0.05


class Block(torch.nn.Module):
    """A residual MLP (names AutoTP pairs: ``fc`` -> ``proj``), then a residual MoE."""

    def __init__(self, ep: int):
        super().__init__()
        self.fc = torch.nn.Linear(mc.H, 4 * mc.H)
        self.proj = torch.nn.Linear(4 * mc.H, mc.H)
        expert = torch.nn.Sequential(torch.nn.Linear(mc.H, 2 * mc.H), torch.nn.ReLU(),
                                     torch.nn.Linear(2 * mc.H, mc.H))
        self.moe = MoE(mc.H, expert, num_experts=mc.E, ep_size=ep, k=2, capacity_factor=1.0,
                       eval_capacity_factor=1.0, min_capacity=2, drop_tokens=True,
                       use_rts=False, top2_2nd_expert_sampling=False)

    def forward(self, h):
        h = h + self.proj(torch.relu(self.fc(h)))
        y, l_aux, _ = self.moe(h)
        return h + y, l_aux


class Net(torch.nn.Module):
    def __init__(self, ep: int):
        super().__init__()
        self.inp = torch.nn.Linear(mc.H, mc.H)
        self.blocks = torch.nn.ModuleList([Block(ep)])
        self.out = torch.nn.Linear(mc.H, 1)

    def forward(self, x):
        h, aux = torch.relu(self.inp(x)), 0.0
        for block in self.blocks:
            h, l_aux = block(h)
            aux = aux + l_aux
        return self.out(h).pow(2).mean() + 0.1 * aux


def reference_state() -> dict[str, torch.Tensor]:
    """The initial weights (every expert different; global names)."""
    torch.manual_seed(0)
    net = Net(1)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if ".deepspeed_experts." in name:
                p.add_(torch.randn(p.shape) * 0.3)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


class Reference:
    """Plain torch on one process: every expert, the mean of every replica's loss."""

    def __init__(self, state: dict[str, torch.Tensor], clip: float):
        self.net, self.clip = Net(1), clip
        self.net.load_state_dict(state)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=mc.LR, betas=(0.9, 0.99),
                                     eps=1e-4, weight_decay=0.0)
        self.norm = 0.0

    def step(self, xs: torch.Tensor) -> None:
        self.opt.zero_grad()
        (sum(self.net(x) for x in xs) / len(xs)).backward()
        self.norm = float(torch.nn.utils.clip_grad_norm_(
            self.net.parameters(), self.clip if self.clip else float("inf")))
        self.opt.step()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.net.state_dict().items()}


def engine_for(case: mc.Case, state: dict[str, torch.Tensor]):
    """An engine over this rank's experts of ``state``; the other ranks of its tensor
    group start from other weights, the other replicas from other dense weights:
    initialize's broadcasts must make them equal."""
    data, tensor = divmod(dist.get_rank(), T)
    net = Net(EP)
    net.load_state_dict(mc.to_local(state, EP, data))
    with torch.no_grad():
        for name, p in net.named_parameters():
            if tensor or (data and ".deepspeed_experts." not in name):
                p.add_(1.0)
    cfg = mc.config(case, dist.get_world_size() // T) | {"tensor_parallel":
                                                          {"autotp_size": T}}
    return deepshard.initialize(model=net, config=cfg)[0]


def diff(module: torch.nn.Module, ref: dict[str, torch.Tensor]) -> float:
    """Largest difference of this rank's tensors from the reference's (global expert
    names; this tensor-parallel rank's shard of the split ones)."""
    data, tensor = divmod(dist.get_rank(), T)
    layout = tp_layout(module)
    worst = 0.0
    for name, p in module.state_dict().items():
        want = ref[mc.to_global(name, EP, data)]
        if name in layout:
            want = shard_tensor(want, layout[name], tensor, T, name)
        worst = max(worst, float((p.float() - want).abs().max()))
    return worst


def train(engine, ref: Reference, steps: range) -> list[dict]:
    data = dist.get_rank() // T
    out = []
    for step in steps:
        xs = mc.batch(step, dist.get_world_size() // T)
        engine.backward(engine(xs[data]))
        engine.step()
        ref.step(xs)
        out.append({"diff": diff(engine.module, ref.state()), "ref_norm": ref.norm,
                    "norm": engine.get_global_grad_norm()})
    return out


def run_case(case: mc.Case, save_dir: Path | None) -> dict:
    state = reference_state()
    ref = Reference(state, case.clip)
    engine = engine_for(case, state)
    result: dict = {"sharded": sorted(tp_layout(engine.module)),
                    "steps": train(engine, ref, range(STEPS))}
    if save_dir is not None:
        engine.save_checkpoint(str(save_dir), tag="tp")
        engine.destroy()
        saved = ref.state()
        engine = engine_for(case, state)  # the initial weights, until the load
        engine.load_checkpoint(str(save_dir), tag="tp")
        result["loaded"] = diff(engine.module, saved)
        result["resumed"] = train(engine, ref, range(STEPS, STEPS + 1))
        if dist.get_rank() == 0:
            full = deepshard.get_fp32_state_dict(str(save_dir), tag="tp")
            result["consolidated"] = {
                "keys": sorted(full) == sorted(saved),
                "diff": max(float((full[k].float() - v).abs().max()) for k, v in saved.items())}
    engine.destroy()
    return result


def main() -> None:
    deepshard.init_distributed()
    torch.set_num_threads(1)
    save_dir = Path(sys.argv[-1])
    cases = {}
    for stage in (0, 1, 2):
        for clip in (0.0, CLIP):
            case = mc.Case(EP, 2, True, stage, "adam", clip)
            keep = save_dir if (stage, clip) == (1, CLIP) else None
            cases[case.label] = run_case(case, keep)
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "cases": cases}), flush=True)


if __name__ == "__main__":
    main()
