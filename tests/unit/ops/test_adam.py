"""``deepspeed.ops.adam``: DeepSpeed's ``FusedAdam`` and ``DeepSpeedCPUAdam`` constructors on
torch's fused Adam, step for step equal to torch's ``AdamW`` / ``Adam`` (fp32, 1e-6), with
DeepSpeed's ``bias_correction=False``, ``set_grad_none`` and refusals; and as a client
optimizer of ``deepshard.initialize`` at every ZeRO stage."""

from __future__ import annotations

import copy

import pytest
import torch

import deepshard
from deepshard.runtime.optim.adam import DeepSpeedCPUAdam, FusedAdam

TOL = dict(rtol=1e-6, atol=1e-6)


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(7, 5, generator=gen)),
            torch.nn.Parameter(torch.randn(11, generator=gen))]


def run(optimizer, ps, steps: int = 6, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()


@pytest.mark.parametrize(("make", "decoupled"), [
    (lambda ps, **kw: FusedAdam(ps, **kw), True),
    (lambda ps, **kw: FusedAdam(ps, adam_w_mode=False, **kw), False),
    (lambda ps, **kw: DeepSpeedCPUAdam(ps, **kw), True),
    (lambda ps, **kw: DeepSpeedCPUAdam(ps, adamw_mode=False, **kw), False),
])
def test_steps_equal_torchs_adamw_or_adam(make, decoupled):
    hp = dict(lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    ours, ref = params(), params()
    opt = make(ours, **hp)
    assert all(g["fused"] for g in opt.param_groups)  # torch's fused kernel on the CPU
    run(opt, ours)
    run((torch.optim.AdamW if decoupled else torch.optim.Adam)(ref, **hp), ref)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    state = opt.state[ours[0]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 6


def uncorrected_reference(ps, grads_per_step, lr, b1, b2, eps, wd, decoupled):
    """Adam without bias correction, from the formulas, element by element (float64)."""
    values = [p.detach().double().clone() for p in ps]
    m = [torch.zeros_like(v) for v in values]
    v2 = [torch.zeros_like(v) for v in values]
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            g = g.double() + (0 if decoupled else wd * values[i])
            m[i] = b1 * m[i] + (1 - b1) * g
            v2[i] = b2 * v2[i] + (1 - b2) * g * g
            if decoupled:
                values[i] = values[i] * (1 - lr * wd)
            values[i] = values[i] - lr * m[i] / (v2[i].sqrt() + eps)
    return values


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_bias_correction_off_per_group_beside_a_corrected_group(adam_w_mode):
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.05
    plain, corrected = params(0), params(1)
    twin = params(1)
    opt = FusedAdam([{"params": plain, "bias_correction": False}, {"params": corrected}],
                    lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, adam_w_mode=adam_w_mode)
    gen = torch.Generator().manual_seed(2)
    history = []
    torch_twin = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(
        twin, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in plain]
        history.append(grads)
        for p, g in zip(plain, grads, strict=True):
            p.grad = g.clone()
        for p, q in zip(corrected, twin, strict=True):
            p.grad = q.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        torch_twin.step()
    want = uncorrected_reference(params(0), history, lr, b1, b2, eps, wd, adam_w_mode)
    for p, w in zip(plain, want, strict=True):
        torch.testing.assert_close(p.detach(), w.float(), **TOL)
    for p, q in zip(corrected, twin, strict=True):
        torch.testing.assert_close(p, q, **TOL)
    assert float(opt.state[plain[0]]["step"]) == 4


def test_amsgrad_is_refused_as_in_deepspeed():
    with pytest.raises(RuntimeError, match="FusedAdam does not support the AMSGrad variant"):
        FusedAdam(params(), amsgrad=True)
    with pytest.raises(RuntimeError, match="DeepSpeedCPUAdam does not support the AMSGrad"):
        DeepSpeedCPUAdam(params(), amsgrad=True)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([{"params": params(), "amsgrad": True}])


def test_zero_grad_follows_set_grad_none():
    ps = params()
    for set_grad_none, expect_none in ((True, True), (False, False)):
        opt = FusedAdam(ps, set_grad_none=set_grad_none)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.zero_grad()
        assert all((p.grad is None) == expect_none for p in ps)
        if not expect_none:
            assert all(float(p.grad.abs().sum()) == 0 for p in ps)


def test_state_dict_round_trip_continues_identically():
    a, b = params(), params()
    first = FusedAdam(a, lr=1e-2, weight_decay=0.01)
    run(first, a, steps=3)
    for x, y in zip(a, b, strict=True):
        y.data.copy_(x.data)
    second = FusedAdam(b, lr=1e-2, weight_decay=0.01)
    second.load_state_dict(copy.deepcopy(first.state_dict()))  # torch shares the tensors
    run(first, a, steps=2, seed=5)
    run(second, b, steps=2, seed=5)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert second.param_groups[0]["bias_correction"] is True


# -- as initialize's optimizer= ------------------------------------------------------------


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fused_adam_is_an_engines_client_optimizer(stage, one_process):
    net, ref = tiny(), tiny()
    opt = FusedAdam(net.parameters(), lr=1e-2, weight_decay=0.01)
    engine, returned, _, _ = deepshard.initialize(
        model=net, optimizer=opt,
        config={"train_batch_size": 4, "gradient_clipping": 0,
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    assert returned is opt
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 4, generator=gen), torch.randn(4, 1, generator=gen)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    with torch.no_grad(), deepshard.zero.GatheredParameters(list(net.parameters())):
        for a, b in zip(net.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a.detach().float(), b.detach(), **TOL)
