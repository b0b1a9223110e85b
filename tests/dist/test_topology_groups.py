"""The topology's process groups and a 1F1B batch on 8 real gloo ranks (ds-run), checked
against the grid's arithmetic and a single-process reference."""

from __future__ import annotations

import sys

import torch

from deepshard.runtime.parallel.pipe_module import PipelineModule
from deepshard.runtime.parallel.topology import Topology
from tests.helpers import ROOT, run_ds, tagged_json

SCRIPTS = ROOT / "tests" / "dist" / "scripts"
sys.path.insert(0, str(SCRIPTS))
from pipe_train import M, batch, layers  # noqa: E402

WORLD = 8


def reference_grads(data_replicas: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The whole model in one process over every replica's micro-batches."""
    whole = PipelineModule(layers(), num_stages=1, stage_id=0, seed_layers=True)
    losses = []
    for data in range(data_replicas):
        x, y = batch(data)
        total = 0.0
        for mb in range(M):
            loss = torch.nn.functional.mse_loss(whole(x[mb]), y[mb]) / M
            (loss / data_replicas).backward()
            total += loss.item()
        losses.append(total)
    return {n: p.grad for n, p in whole.named_parameters()}, losses


def test_groups_and_a_pipelined_batch_on_eight_ranks():
    result = run_ds("--num_gpus", str(WORLD), str(SCRIPTS / "pipe_train.py"), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    results = {rank: data for rank, (_, data) in tagged_json(result.stdout, "RESULT").items()}
    assert sorted(results) == list(range(WORLD))

    grid = Topology.from_config(WORLD, pipe_stages=2, tp_size=2)
    for rank, data in results.items():
        seen = data["groups"]
        for axis in ("pipe", "data", "tensor", "model"):
            members = (grid.model_parallel_groups()[grid.coord(rank).data] if axis == "model"
                       else grid.group_of(axis, rank))
            assert seen[axis]["sum"] == sum(members), (rank, axis)
            assert seen[axis]["size"] == len(members) == seen[axis]["mpu"][1]
            assert seen[axis]["group_rank"] == members.index(rank) == seen[axis]["mpu"][0]
        prev, nxt = grid.prev_stage_rank(rank), grid.next_stage_rank(rank)
        assert seen["p2p"] == [prev, nxt, float(rank if nxt is not None else prev)]

    pipe = Topology.from_config(WORLD, pipe_stages=4)
    expected, losses = reference_grads(pipe.data)
    covered = set()
    for rank, data in results.items():
        run = data["pipe"]
        assert (run["stage"], run["data"]) == pipe.coord(rank)[:2]
        assert run["left"] == [0] * 5  # every buffer consumed
        if run["stage"] == pipe.pipe - 1:
            assert abs(run["loss"] - losses[run["data"]]) < 1e-5
        for name, grad in run["grads"].items():
            assert torch.allclose(torch.tensor(grad), expected[name].flatten(), atol=1e-6), \
                (rank, name)
            covered.add(name)
    assert covered == set(expected)
