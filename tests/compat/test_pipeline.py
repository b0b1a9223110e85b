"""``scripts/pipeline_mlp.py`` (training/pipeline_parallelism/train.py's pattern): an MLP
given as LayerSpecs, a 2-stage PipelineModule on 2 ranks, ``engine.train_batch(data_iter=
iter(RepeatingLoader(loader)))`` — against the same MLP in one process.

With ``seed_layers=True`` every layer is built from ``base_seed + index`` on whichever stage
owns it, so the reference builds identical layers. One pipeline step is
``gradient_accumulation_steps`` micro-batches (dp = 1: train_batch_size / micro); the
reference accumulates ``loss / gas`` over them, clips the global norm at 1.0 (the default
when the config leaves ``gradient_clipping`` out), takes one Adam step (DeepSpeed's "Adam"
is AdamW; no weight decay here) and records the micro-batch losses' mean, which is what
``train_batch`` returns on every stage. Each stage's weights are compared with the
reference's layers of the same index.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.compat.common import DEFAULT_CLIP, SCRIPTS, TOL, loss_diff, max_diff, run_compat
from tests.compat.scripts.tiny_models import mlp_layer_specs, plain_spec, synthetic_vectors

CONFIG = json.loads((SCRIPTS / "pipeline_config.json").read_text())
STEPS, BASE_SEED = 4, 1234  # the script's --steps, PipelineModule's default base_seed


def reference(relu_at_split: bool = False):
    """Plain torch, one process: per-step mean losses and final weights."""
    layers = []
    for index, spec in enumerate(mlp_layer_specs(plain_spec, relu_at_split=relu_at_split)):
        torch.manual_seed(BASE_SEED + index)
        layers.append(spec.build())
    net = nn.Sequential(*layers)
    params = CONFIG["optimizer"]["params"]
    opt = torch.optim.AdamW(net.parameters(), lr=params["lr"], betas=params["betas"],
                            eps=params["eps"], weight_decay=0.0)
    batch, micro = CONFIG["train_batch_size"], CONFIG["train_micro_batch_size_per_gpu"]
    gas = batch // micro
    x, y = synthetic_vectors(batch * STEPS).tensors
    criterion = nn.CrossEntropyLoss()
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        micro_losses = []
        for m in range(gas):
            start = step * batch + m * micro
            loss = criterion(net(x[start:start + micro]), y[start:start + micro])
            (loss / gas).backward()
            micro_losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(net.parameters(), DEFAULT_CLIP)
        opt.step()
        losses.append(sum(micro_losses) / gas)
    return losses, net.state_dict()


@pytest.mark.parametrize("variant", ["data_iter", "training_data", "relu_at_split"])
def test_two_stage_pipeline_matches_one_process(tmp_path, variant):
    extra = {"training_data": ["--training_data"],
             "relu_at_split": ["--relu_at_split"]}.get(variant, [])
    stdout: list[str] = []
    ranks = run_compat("pipeline_mlp.py", tmp_path, "--deepspeed_config",
                       str(SCRIPTS / "pipeline_config.json"), "--steps", str(STEPS), *extra,
                       output=stdout)
    want_losses, want_state = reference(relu_at_split=variant == "relu_at_split")
    # DeepSpeed's pipeline progress line, every steps_per_print (2) steps, on rank 0
    progress = [line.split("] ", 1)[1] for line in stdout[0].splitlines()
                if "] steps: " in line]
    assert [p.split(" iter time")[0] for p in progress] == [
        f"steps: {s} loss: {want_losses[s - 1]:0.4f}" for s in (2, 4)]
    owned = set()
    for rank, saved in enumerate(ranks):
        assert saved["stage"] == rank
        assert loss_diff(saved["losses"], want_losses) < TOL, (rank, saved["losses"],
                                                               want_losses)
        state = saved["state"]
        owned |= set(state)
        diff, where = max_diff(state, {k: want_state[k] for k in state})
        assert diff < TOL, (rank, where, diff)
    assert owned == set(want_state)  # the two stages hold the whole model between them
