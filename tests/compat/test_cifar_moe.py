"""``scripts/cifar_moe.py`` (training/cifar/cifar10_deepspeed.py with ``--moe``) on 2 ranks
with expert parallelism 2 against one process of plain torch holding every expert.

Each rank holds half of every layer's experts (rank ``r`` the global experts ``r * L ..
r * L + L - 1``) and routes its micro-batch's tokens to all of them. The reference is
the same net at ``ep_size`` 1 (deepshard's MoE layer, run in this process without a
process group), fed the two ranks' micro-batches separately (an expert's capacity counts
one rank's tokens) and stepped on the mean of their losses, through AdamW, global-norm
clipping at 1.0 and DeepSpeed's WarmupLR, as ``test_cifar_style``. ``--min-capacity`` is
the micro-batch (4 tokens), so that no token is dropped and random token selection (the
example's default) never decides.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler

from deepshard.moe.layer import MoE
from tests.compat.common import SCRIPTS, TOL, loss_diff, max_diff, run_compat
from tests.compat.scripts.cifar_moe_model import Net
from tests.compat.scripts.tiny_models import synthetic_images
from tests.compat.test_cifar_style import warmup_lr

CONFIG = json.loads((SCRIPTS / "cifar_moe_config.json").read_text())
WORLD, EP, SAMPLES, SEED, EPOCHS, MIN_CAPACITY = 2, 2, 16, 1138, 2, 4
EXPERT = re.compile(r"moe_layer_list\.(\d+)\.(.*\.deepspeed_experts\.)(\d+)(\..*)")


def reference(num_experts: list[int]):
    """Plain torch, one process with every expert: per-step losses and final weights."""
    trainset = synthetic_images(SAMPLES)
    args = SimpleNamespace(moe=True, num_experts=num_experts, ep_world_size=1,
                           mlp_type="standard", top_k=1, min_capacity=MIN_CAPACITY,
                           noisy_gate_policy=None)
    torch.manual_seed(SEED)
    net = Net(args, MoE)
    p = CONFIG["optimizer"]["params"]
    opt = torch.optim.AdamW(net.parameters(), lr=p["lr"], betas=p["betas"], eps=p["eps"],
                            weight_decay=p["weight_decay"])
    micro = CONFIG["train_batch_size"] // WORLD
    criterion = torch.nn.CrossEntropyLoss()
    losses, step = [], 0
    for _ in range(EPOCHS):
        # the sampler's epoch stays 0 (DeepSpeed's loader never sets it): every epoch
        # has the first one's order
        orders = [list(DistributedSampler(trainset, num_replicas=WORLD, rank=r))
                  for r in range(WORLD)]
        for i in range(len(orders[0]) // micro):
            parts = [trainset[order[i * micro:(i + 1) * micro]] for order in orders]
            loss = sum(criterion(net(x), y) for x, y in parts) / WORLD
            for group in opt.param_groups:
                group["lr"] = warmup_lr(step, CONFIG["scheduler"]["params"])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), CONFIG["gradient_clipping"])
            opt.step()
            losses.append(loss.item())
            step += 1
    return losses, net.state_dict()


def to_global(state: dict, rank: int, num_experts: list[int]) -> dict:
    """Rank ``rank``'s state dict with its experts under their global numbers."""
    out = {}
    for name, value in state.items():
        m = EXPERT.fullmatch(name)
        if m is not None:
            local = num_experts[int(m.group(1))] // EP
            name = (f"moe_layer_list.{m.group(1)}.{m.group(2)}"
                    f"{rank * local + int(m.group(3))}{m.group(4)}")
        out[name] = value
    return out


@pytest.mark.parametrize(("stage", "num_experts", "param_group"),
                         [(2, [2, 4], True), (0, [4], False)])
def test_cifar_moe_script_with_ep_2_matches_one_process_with_every_expert(
        stage, num_experts, param_group, tmp_path):
    args = ["--deepspeed_config", str(SCRIPTS / "cifar_moe_config.json"), "--stage",
            str(stage), "--moe", "--ep-world-size", str(EP), "--num-experts",
            *map(str, num_experts), "--top-k", "1", "--min-capacity", str(MIN_CAPACITY),
            "--epochs", str(EPOCHS)]
    ranks = run_compat("cifar_moe.py", tmp_path, *args,
                       *(["--moe-param-group"] if param_group else []))
    want_losses, want_state = reference(num_experts)
    experts = {r: to_global(saved["state"], r, num_experts) for r, saved in enumerate(ranks)}
    for rank, saved in enumerate(ranks):
        assert len(saved["losses"]) == 4
        assert loss_diff(saved["losses"], want_losses) < TOL, (rank, saved["losses"],
                                                               want_losses)
        mine = {k: want_state[k] for k in experts[rank]}
        diff, where = max_diff(experts[rank], mine)
        assert diff < TOL, (rank, where, diff)
    held = set(experts[0]) | set(experts[1])
    assert held == set(want_state), sorted(set(want_state) ^ held)
