"""OneBitLamb in one process (a one-rank group): DeepSpeed's 1-bit LAMB update through the
warm-up and the compression stage, the freeze on scripted step counts, masks, the engine
protocol and checkpoint state.

:class:`ReferenceOneBitLamb` is DeepSpeed's ``OnebitLamb.step`` for ``world`` simulated ranks,
one tensor and one formula at a time, on DeepSpeed's own step counter (which its
initialization step starts at 1); the multi-rank test (tests/dist/test_onebit_lamb.py) uses
it too, with the compressed all-reduce of every rank's flat momentum done by ``simulate``.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from deepshard.runtime.optim.onebit.compressed import padded_numel, simulate
from deepshard.runtime.optim.onebit.lamb import OneBitLamb
from tests.unit.runtime.optim.onebit.nets import backward, mask_of, model, run


class ReferenceOneBitLamb:
    """``params[r]``: rank ``r``'s parameters (updated in place, the same on every rank);
    ``lrs[i]``: parameter ``i``'s learning rate; ``masks[i]``: its ``exp_avg_mask``."""

    def __init__(self, params, lrs, freeze_step, betas, eps, weight_decay, max_coeff=10.0,
                 min_coeff=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5,
                 factor_threshold=0.1, masks=None):
        self.params, self.world, self.lrs, self.freeze_step = params, len(params), lrs, freeze_step
        self.betas, self.eps, self.wd = betas, eps, weight_decay
        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.fmax, self.fmin, self.fth = factor_max, factor_min, factor_threshold
        self.masks = masks or [None] * len(params[0])
        shapes = [p.shape for p in params[0]]
        self.m = [[torch.zeros(s) for s in shapes] for _ in params]
        self.v = [torch.zeros(s) for s in shapes]
        self.fresh = [torch.zeros(s) for s in shapes]
        self.coeff_freeze = [0.0] * len(shapes)
        self.last_factor = [1.0] * len(shapes)
        self.scaling = None
        self.t, self.frozen = 1, False  # DeepSpeed's initialization step
        n = sum(p.numel() for p in params[0])
        self.n, self.padded = n, padded_numel(n, self.world)
        self.workers = [torch.zeros(self.padded) for _ in range(self.world)]
        self.servers = [torch.zeros(self.padded // self.world) for _ in range(self.world)]
        self.coeffs = []

    @torch.no_grad()
    def step(self, grads):
        """``grads[r][i]``: rank ``r``'s local gradient (averaged here during the warm-up)."""
        self.t += 1
        self.coeffs = []
        if not self.frozen:
            self._warmup(grads)
            if self.t >= self.freeze_step:
                self.frozen = True
        else:
            self._compressed(grads)

    def _lamb_coeff(self, p, update, i):
        weight_norm, update_norm = p.pow(2).sum().sqrt(), update.pow(2).sum().sqrt()
        coeff = 1.0
        if weight_norm != 0 and update_norm != 0:
            coeff = min(max((weight_norm / update_norm).item(), self.min_coeff), self.max_coeff)
        return coeff

    def _warmup(self, grads):
        b1, b2 = self.betas
        for i in range(len(self.v)):
            g = sum(grads[r][i] for r in range(self.world)) / self.world
            self.v[i].mul_(b2).addcmul_(g, g, value=1 - b2)
            if self.t == self.freeze_step:
                self.fresh[i] = self.v[i].clone()
            for r in range(self.world):
                m, p = self.m[r][i], self.params[r][i]
                m.mul_(b1).add_(g, alpha=1 - b1)
                update = m / (self.v[i].sqrt() + self.eps)
                if self.wd > 0.0:
                    update += self.wd * p
                coeff = self._lamb_coeff(p, update, i)
                if r == 0:
                    if coeff != 1.0:
                        self.coeff_freeze[i] = (self.coeff_beta * self.coeff_freeze[i]
                                                + (1 - self.coeff_beta) * coeff)
                    self.coeffs.append(coeff)
                p.add_(-self.lrs[i] * coeff * update)

    def _allreduce(self):
        if self.world == 1:
            return
        flats = [torch.cat([m.reshape(-1) for m in ms] + [torch.zeros(self.padded - self.n)])
                 for ms in self.m]
        simulate(flats, self.workers, self.servers)
        for ms, flat in zip(self.m, flats, strict=True):
            offset = 0
            for m in ms:
                m.copy_(flat[offset:offset + m.numel()].view(m.shape))
                offset += m.numel()

    def _compressed(self, grads):
        b1, b2 = self.betas
        last = [[m.clone() for m in ms] for ms in self.m]
        if self.scaling is None:
            scales = [(torch.linalg.vector_norm(m) / np.sqrt(m.numel())).item() for m in self.m[0]]
            united = sum(scales) / len(scales)
            self.scaling = [united / s for s in scales]
        for r in range(self.world):
            for i, g in enumerate(grads[r]):
                self.m[r][i].mul_(b1).add_(g, alpha=1 - b1).mul_(self.scaling[i])
        self._allreduce()
        for r in range(self.world):
            for i, m in enumerate(self.m[r]):
                m.div_(self.scaling[i])
                if self.masks[i] is not None:
                    m.mul_(self.masks[i])
                rebuilt = (m - last[r][i] * b1) / (1 - b1)
                if r == 0:
                    self.fresh[i].mul_(b2).addcmul_(rebuilt, rebuilt, value=1 - b2)
                self._frozen_update(r, i, m)

    def _frozen_update(self, r, i, m):
        p = self.params[r][i]
        denom = self.v[i].sqrt() + self.eps
        prelim = m / denom
        update = prelim + self.wd * p if self.wd > 0.0 else prelim
        update_norm = update.pow(2).sum().sqrt()
        factor = (denom / (self.fresh[i].sqrt() + self.eps)).max().item()
        if self.wd > 0.0:
            ratio = min(1.0, (prelim.pow(2).sum().sqrt() / update_norm).item())
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.fmin), self.fmax)
        last = self.last_factor[i]
        if factor > last * (1.0 + self.fth):
            factor = last * (1.0 + self.fth)
        if factor < last * (1.0 - self.fth):
            factor = last * (1.0 - self.fth)
        coeff = self.coeff_freeze[i] * factor
        if r == self.world - 1:
            self.last_factor[i] = factor
        if r == 0:
            self.coeffs.append(coeff)
        p.add_(-self.lrs[i] * coeff * update)


HP = dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, coeff_beta=0.7, factor_threshold=0.2)
FREEZE = 6  # DeepSpeed's counter reaches 6 at update 5: five warm-up updates


def groups_of(net: torch.nn.Module) -> list[dict]:
    return [{"params": list(net[0].parameters())},
            {"params": [net[2].weight], "lr": 0.02, "exp_avg_mask": mask_of(net)},
            {"params": [net[2].bias]}]


def params_of(net):
    return [net[0].weight, net[0].bias, net[2].weight, net[2].bias]


def test_signature_is_deepspeeds_plus_a_keyword_only_group():
    sig = inspect.signature(OneBitLamb)
    assert {n: p.default for n, p in sig.parameters.items() if n not in ("params", "group")} == {
        "deepspeed": None, "lr": 1e-3, "freeze_step": 100000, "bias_correction": True,
        "betas": (0.9, 0.999), "eps": 1e-8, "eps_inside_sqrt": False, "weight_decay": 0.0,
        "max_grad_norm": 0.0, "max_coeff": 10.0, "min_coeff": 0.01, "amsgrad": False,
        "cuda_aware": False, "comm_backend_name": "nccl", "coeff_beta": 0.9,
        "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}
    assert list(sig.parameters)[:2] == ["params", "deepspeed"]
    assert sig.parameters["group"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("bad", [dict(amsgrad=True), dict(lr=-1.0), dict(coeff_beta=1.5),
                                 dict(min_coeff=2.0, max_coeff=1.0), dict(factor_min=5.0)])
def test_bad_arguments_are_value_errors(bad):
    with pytest.raises(ValueError):
        OneBitLamb(model().parameters(), **bad)


def test_warm_up_then_compression_follow_deepspeeds_onebit_lamb(one_rank_group):
    net, ref_net = model(), model()
    opt = OneBitLamb(groups_of(net), lr=0.01, freeze_step=FREEZE, **HP)
    ref = ReferenceOneBitLamb([params_of(ref_net)], [0.01, 0.01, 0.02, 0.01], FREEZE,
                              masks=[None, None, mask_of(net), None], **HP)
    seen, frozen_v = [], None
    for k in range(1, 15):
        seen.append(opt.communicates_next_step())
        backward(net, k)
        backward(ref_net, k)
        opt.step()
        ref.step([[p.grad for p in params_of(ref_net)]])
        for i, (p, q) in enumerate(zip(params_of(net), params_of(ref_net), strict=True)):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"step {k} param {i}")
        assert opt.get_lamb_coeffs() == pytest.approx(ref.coeffs, rel=1e-6), k
        if k == FREEZE - 1:
            frozen_v = [opt.state[p]["exp_avg_sq"].clone() for p in params_of(net)]
            assert all(torch.equal(opt.state[p]["exp_avg_sq_fresh"], v)
                       for p, v in zip(params_of(net), frozen_v, strict=True))
    assert seen == [False] * (FREEZE - 1) + [True] * (15 - FREEZE)
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], v)
               for p, v in zip(params_of(net), frozen_v, strict=True))
    assert not all(torch.equal(opt.state[p]["exp_avg_sq_fresh"], v)
                   for p, v in zip(params_of(net), frozen_v, strict=True))
    assert torch.all(opt.state[net[2].weight]["exp_avg"][1] == 0)  # masked after the freeze
    assert opt.last_bytes_sent == 0


def test_freeze_step_below_two_still_warms_up_once(one_rank_group):
    opt = OneBitLamb(model().parameters(), freeze_step=0)
    assert opt.warmup_steps() == 1 and not opt.communicates_next_step()


def test_checkpoint_state_is_shared_and_a_resume_continues_exactly(one_rank_group):
    net, again = model(), model()
    opt = OneBitLamb(groups_of(net), lr=0.01, freeze_step=FREEZE, **HP)
    run(opt, net, range(1, 9))
    state, errors = opt.state_dict(), {k: v.clone() for k, v in opt.error_state().items()}
    assert set(errors) == {"worker_error", "server_error"}
    for per_param in state["state"].values():
        assert set(per_param) == {"step", "exp_avg", "exp_avg_sq", "exp_avg_sq_fresh",
                                  "lamb_coeff_freeze", "last_factor", "scaling_coeff"}
    again.load_state_dict(net.state_dict())
    resumed = OneBitLamb(groups_of(again), lr=0.01, freeze_step=FREEZE, **HP)
    resumed.load_state_dict(state)
    resumed.load_error_state(errors)
    assert resumed.communicates_next_step()
    run(opt, net, range(9, 14))
    run(resumed, again, range(9, 14))
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), again.parameters(),
                                                 strict=True))
    resumed.load_error_state(None)
    assert all(t.abs().sum() == 0 for t in resumed.error_state().values())


def test_frozen_and_empty_parameters_are_left_alone(one_rank_group):
    net = model()
    net[0].bias.requires_grad_(False)
    empty = torch.nn.Parameter(torch.zeros(0))
    opt = OneBitLamb([*net.parameters(), empty], lr=0.01, freeze_step=3)
    bias = net[0].bias.detach().clone()
    for k in range(1, 5):  # through the first compressed step (scaling coefficients)
        backward(net, k)
        opt.step()
    assert torch.equal(net[0].bias, bias)
    assert net[0].bias not in opt.state and empty not in opt.state
    assert len(opt.get_lamb_coeffs()) == 3
    with pytest.raises(ValueError, match="requires grad"):
        OneBitLamb([net[0].bias], freeze_step=3).step()
