"""``scripts/cifar_style.py`` (training/cifar/cifar10_deepspeed.py's pattern) at ZeRO 0 and 2
against one process of plain torch on the whole global batch.

The script takes its data loader from ``deepspeed.initialize(training_data=...)``: a
``DistributedSampler`` per rank (shuffled, seed 0, as DeepSpeed's), micro-batches of
``train_batch_size / world``. The reference replays the same samples, the two ranks'
micro-batches side by side, through AdamW (DeepSpeed's "Adam" decouples weight decay),
global-norm clipping (0.3 in the config, so that it acts on some steps; the example has
1.0) and DeepSpeed's WarmupLR (log warm-up; the first step at the minimum, before the
scheduler has stepped).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.data import DistributedSampler

from tests.compat.common import SCRIPTS, TOL, loss_diff, max_diff, run_compat
from tests.compat.scripts.tiny_models import Net, synthetic_images

CONFIG = json.loads((SCRIPTS / "cifar_config.json").read_text())
WORLD, SAMPLES, SEED = 2, 32, 1138  # the script's defaults


def warmup_lr(step: int, params: dict) -> float:
    """The learning rate DeepSpeed's WarmupLR gives optimizer step ``step`` (0-based): the
    scheduler starts at iteration -1 (min lr) and steps after each optimizer step."""
    last = step - 1
    if last < 0:
        return params["warmup_min_lr"]
    n = max(2, params["warmup_num_steps"])
    gamma = math.log(last + 1) / math.log(n) if last < n else 1.0
    return params["warmup_min_lr"] + (params["warmup_max_lr"] - params["warmup_min_lr"]) * gamma


def reference():
    """Plain torch, one process: per-step losses and final weights."""
    trainset = synthetic_images(SAMPLES)
    torch.manual_seed(SEED)
    net = Net()
    opt_params = CONFIG["optimizer"]["params"]
    opt = torch.optim.AdamW(net.parameters(), lr=opt_params["lr"],
                            betas=opt_params["betas"], eps=opt_params["eps"],
                            weight_decay=opt_params["weight_decay"])
    micro = CONFIG["train_batch_size"] // WORLD
    orders = [list(DistributedSampler(trainset, num_replicas=WORLD, rank=r))
              for r in range(WORLD)]
    criterion = torch.nn.CrossEntropyLoss()
    losses = []
    for step in range(len(orders[0]) // micro):
        index = [i for order in orders for i in order[step * micro:(step + 1) * micro]]
        inputs, labels = trainset[index]
        for group in opt.param_groups:
            group["lr"] = warmup_lr(step, CONFIG["scheduler"]["params"])
        loss = criterion(net(inputs), labels)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CONFIG["gradient_clipping"])
        opt.step()
        losses.append(loss.item())
    return losses, net.state_dict()


@pytest.mark.parametrize("stage", [0, 2])
def test_cifar_style_script_matches_plain_torch(stage, tmp_path):
    ranks = run_compat("cifar_style.py", tmp_path, "--deepspeed_config",
                       str(SCRIPTS / "cifar_config.json"), "--stage", str(stage))
    want_losses, want_state = reference()
    for rank, saved in enumerate(ranks):
        assert len(saved["losses"]) == 4
        assert loss_diff(saved["losses"], want_losses) < TOL, (rank, saved["losses"],
                                                               want_losses)
        diff, where = max_diff(saved["state"], want_state)
        assert diff < TOL, (rank, where, diff)
