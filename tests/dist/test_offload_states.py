"""``engine.offload_states()`` / ``reload_states()`` (DeepSpeed's, used by RLHF trainers
between training and generation) at ZeRO stages 1-3.

On this CPU-only machine the states are on the host already, so the public calls move
nothing; the rewiring a real move needs (every holder of a tensor seeing its new storage) is
checked by moving each kind into fresh copies instead, after which training must continue
exactly as without the round trip."""

from __future__ import annotations

import pytest
import torch

import deepshard
from deepshard.errors import UsageError
from deepshard.runtime.zero.states import OffloadDeviceEnum, OffloadStateTypeEnum


@pytest.fixture(autouse=True)
def _one_process_group(one_process):
    """Every test here builds its engine in a one-process group of its own."""


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def engine_for(stage: int, bf16: bool = False, **zero):
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    **zero}}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepshard.initialize(model=Net(), config=config)
    return engine


def train(engine, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 32, (4, 8), generator=g)
        logits = engine(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 32), x.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


@pytest.mark.parametrize(("stage", "bf16"), [(1, False), (2, False), (3, False), (3, True)])
def test_every_state_kind_moved_and_back_trains_on_exactly(stage, bf16):
    want = train(engine_for(stage, bf16), 4)
    engine = engine_for(stage, bf16)
    first = train(engine, 2)
    engine.offload_states()  # on the host already: nothing moves
    assert not engine._states.away
    engine.reload_states()
    mover = engine._states
    optim = [v for s in engine.optimizer.state.values() for v in s.values()
             if torch.is_tensor(v) and v.numel()]
    before = {id(t): t.data_ptr() for t in optim}
    for kind in OffloadStateTypeEnum:  # each kind into fresh storage, as a real move does
        mover.offloaded[kind] = mover._move(kind, copy, torch.device("meta"))
    assert mover.away
    with pytest.raises(UsageError, match="reload_states"):
        engine.step()
    assert all(t.data_ptr() != before[id(t)] for t in optim)
    moved = mover.offloaded[OffloadStateTypeEnum.lp_grads]
    assert moved and all(t.device.type == "cpu" for t, _ in moved)
    for g in engine.strategy.groups:
        storage = g.shard.untyped_storage().data_ptr()
        if g.partitioned:
            assert all(v.untyped_storage().data_ptr() == storage for v, _, _ in g._views)
        else:  # the parameters are views of the moved buffer
            assert all(p.untyped_storage().data_ptr() == storage for p in g.params)
    if bf16:
        assert mover.offloaded[OffloadStateTypeEnum.hp_params]
    engine.reload_states()
    assert not mover.offloaded and not mover.away
    assert first + train(engine, 2, start=2) == want


def test_refused_where_deepspeed_refuses():
    with pytest.raises(UsageError, match="ZeRO stage 1-3"):
        engine_for(0).offload_states()
    engine = engine_for(2)
    with pytest.raises(UsageError, match="NVMe"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    with pytest.raises(UsageError, match="unknown state kind 'weights'"):
        engine.offload_states(include=["weights"])
    engine.offload_states(device="none")  # DeepSpeed warns and moves nothing
    assert not engine._states.offloaded
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states, "lp_grads"])
    assert set(engine._states.offloaded) == {OffloadStateTypeEnum.optim_states,
                                             OffloadStateTypeEnum.lp_grads}
    with pytest.raises(UsageError, match="offload_param"):
        engine_for(3, offload_param={"device": "cpu"}).offload_states()
