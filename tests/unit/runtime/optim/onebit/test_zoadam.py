"""ZeroOneAdam in one process (a one-rank group): DeepSpeed's 0/1 Adam update through the
variance phase and the frozen phase with local steps, its two schedules on scripted step
counts, masks, the engine protocol and checkpoint state.

:class:`ReferenceZeroOneAdam` is DeepSpeed's ``ZeroOneAdam.step`` for ``world`` simulated
ranks, one tensor and one formula at a time, on DeepSpeed's own step counter (which its
initialization step starts at 1); the multi-rank test (tests/dist/test_zoadam.py) uses it too,
with the compressed all-reduce of every rank's flat buffer done by ``simulate``.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from deepshard.runtime.optim.onebit.compressed import padded_numel, simulate
from deepshard.runtime.optim.onebit.zoadam import ZeroOneAdam
from tests.unit.runtime.optim.onebit.nets import backward, mask_of, model, run


class ReferenceZeroOneAdam:
    """``params[r]``: rank ``r``'s parameters (updated in place); ``lrs[i]``: parameter
    ``i``'s learning rate; ``masks[i]``: its ``exp_avg_mask`` or None."""

    def __init__(self, params, lrs, betas, eps, weight_decay, var_freeze_step,
                 var_update_scaler, local_step_scaler, local_step_clipper, masks=None):
        self.params, self.world, self.lrs = params, len(params), lrs
        self.betas, self.eps, self.wd = betas, eps, weight_decay
        self.vfs, self.vus = var_freeze_step, var_update_scaler
        self.lss, self.lsc = local_step_scaler, local_step_clipper
        self.masks = masks or [None] * len(params[0])
        zeros = [[torch.zeros(p.shape) for p in ps] for ps in params]
        self.m, self.v, self.u = zeros, [[z.clone() for z in zs] for zs in zeros], \
            [[z.clone() for z in zs] for zs in zeros]
        self.lr_sum = [0.0] * len(params[0])
        self.t = 1  # DeepSpeed's initialization step
        self.var_interval, self.var_counter = 1, 0
        self.local_interval, self.local_counter = 1, 0
        self.frozen = False
        n = sum(p.numel() for p in params[0])
        self.n, self.padded = n, padded_numel(n, self.world)
        self.workers = [torch.zeros(self.padded) for _ in range(self.world)]
        self.servers = [torch.zeros(self.padded // self.world) for _ in range(self.world)]

    def compressed(self, tensors):
        """``tensors[r][i]`` replaced by the compressed average (identity on one rank)."""
        if self.world == 1:
            return [[t.clone() for t in ts] for ts in tensors]
        flats = [torch.cat([t.reshape(-1) for t in ts] + [torch.zeros(self.padded - self.n)])
                 for ts in tensors]
        simulate(flats, self.workers, self.servers)
        out, offset = [[] for _ in flats], 0
        for t in tensors[0]:
            for r, flat in enumerate(flats):
                out[r].append(flat[offset:offset + t.numel()].view(t.shape).clone())
            offset += t.numel()
        return out

    def masked(self, tensors):
        for ts in tensors:
            for t, mask in zip(ts, self.masks, strict=True):
                if mask is not None:
                    t.mul_(mask)
        return tensors

    @torch.no_grad()
    def step(self, grads):
        """``grads[r][i]``: rank ``r``'s local gradient of parameter ``i``."""
        self.t += 1
        if not self.frozen:
            self._variance_phase(grads)
        else:
            self._frozen_phase(grads)
        if not self.frozen and self.t > self.vfs:
            self.frozen = True
            for e in (*self.workers, *self.servers):
                e.zero_()

    def _update(self, r, i):
        p, m, v = self.params[r][i], self.m[r][i], self.v[r][i]
        update = m / (v.sqrt() + self.eps)
        if self.wd > 0.0:
            update += self.wd * p
        step = -self.lrs[i] * update
        p.add_(step)
        return step

    def _variance_phase(self, grads):
        b1, b2 = self.betas
        if self.t % self.var_interval == 0:
            mean = [sum(grads[r][i] for r in range(self.world)) / self.world
                    for i in range(len(grads[0]))]
            for r in range(self.world):
                for i, g in enumerate(mean):
                    self.v[r][i].mul_(b2).addcmul_(g, g, value=1 - b2)
                    self.m[r][i].mul_(b1).add_(g, alpha=1 - b1)
        else:
            onebit = self.masked(self.compressed(grads))
            for r in range(self.world):
                for i, g in enumerate(onebit[r]):
                    self.m[r][i].mul_(b1).add_(g, alpha=1 - b1)
        for r in range(self.world):
            for i in range(len(grads[0])):
                self._update(r, i)
        if self.t % self.var_interval == 0:
            self.var_counter += 1
            if self.var_counter == self.vus:
                self.var_counter, self.var_interval = 0, self.var_interval * 2

    def _frozen_phase(self, grads):
        b1 = self.betas[0]
        for r in range(self.world):
            for i, g in enumerate(grads[r]):
                self.m[r][i].mul_(b1).add_(g, alpha=1 - b1)
                self.u[r][i].add_(self._update(r, i))
        self.lr_sum = [s + lr for s, lr in zip(self.lr_sum, self.lrs, strict=True)]
        if self.t % self.local_interval == 0:
            self._sync()
        self.local_counter += 1
        if self.local_counter == self.lss:
            self.local_counter = 0
            self.local_interval = min(self.lsc, self.local_interval * 2)

    def _sync(self):
        denoms = [[v.sqrt() + self.eps for v in vs] for vs in self.v]
        for r in range(self.world):
            for i, u in enumerate(self.u[r]):
                self.params[r][i].add_(-1 * u)
                u.mul_(denoms[r][i])
        self.u = self.masked(self.compressed(self.u))
        for r in range(self.world):
            for i, u in enumerate(self.u[r]):
                self.m[r][i].zero_().add_(u / self.lr_sum[i], alpha=-1)
                self.params[r][i].add_(u / denoms[r][i])
                u.zero_()
        self.lr_sum = [0.0] * len(self.lr_sum)


HP = dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
SCHEDULE = dict(var_freeze_step=12, var_update_scaler=2, local_step_scaler=2,
                local_step_clipper=4)
# DeepSpeed's counter t = k + 1 at update k. Variance steps: t % var_interval == 0, the
# interval doubling after every 2 of them: t = 2, 3 (interval 2), 4, 6 (interval 4), 8, 12
# (interval 8), so k = 1, 2, 3, 5, 7, 11; frozen after t = 13 > 12, from k = 13. Syncs:
# t % local_interval == 0, the interval doubling after every 2 frozen steps up to 4: t = 14,
# 15 (interval 2), 16, [17] (interval 4), [18, 19], 20, [21, 22, 23], 24: k = 13, 14, 15, 19, 23.
VARIANCE_STEPS = {1, 2, 3, 5, 7, 11}
SYNC_STEPS = {13, 14, 15, 19, 23}
STEPS = 24


def groups_of(net: torch.nn.Module, lr2: float = 0.02) -> list[dict]:
    """Two groups: the first layer, and the last layer's weight with a mask and its own lr."""
    return [{"params": list(net[0].parameters())},
            {"params": [net[2].weight], "lr": lr2, "exp_avg_mask": mask_of(net)},
            {"params": [net[2].bias]}]


def reference_for(net: torch.nn.Module, lr: float = 0.01, lr2: float = 0.02):
    params = [net[0].weight, net[0].bias, net[2].weight, net[2].bias]
    return params, ReferenceZeroOneAdam(
        [params], [lr, lr, lr2, lr], masks=[None, None, mask_of(net), None], **HP, **SCHEDULE)


def test_signature_is_deepspeeds_plus_a_keyword_only_group():
    sig = inspect.signature(ZeroOneAdam)
    assert {n: p.default for n, p in sig.parameters.items() if n not in ("params", "group")} == {
        "deepspeed": None, "lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999),
        "eps": 1e-8, "eps_inside_sqrt": False, "weight_decay": 0.0, "max_grad_norm": 0.0,
        "var_freeze_step": 100000, "var_update_scaler": 16, "local_step_scaler": 32678,
        "local_step_clipper": 16, "amsgrad": False, "cuda_aware": False,
        "comm_backend_name": "nccl"}
    assert list(sig.parameters)[:2] == ["params", "deepspeed"]
    assert sig.parameters["group"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("bad", [dict(amsgrad=True), dict(lr=-1.0), dict(betas=(1.0, 0.9)),
                                 dict(var_update_scaler=0), dict(local_step_clipper=0)])
def test_bad_arguments_are_value_errors(bad):
    with pytest.raises(ValueError):
        ZeroOneAdam(model().parameters(), **bad)


def test_updates_and_schedules_follow_deepspeeds_zero_one_adam(one_rank_group):
    net, ref_net = model(), model()
    opt = ZeroOneAdam(groups_of(net), lr=0.01, **HP, **SCHEDULE)
    ref_params, ref = reference_for(ref_net)
    params = [net[0].weight, net[0].bias, net[2].weight, net[2].bias]
    variance, syncs = set(), set()
    for k in range(1, STEPS + 1):
        assert opt.communicates_next_step()
        before = [opt.state[p]["exp_avg_sq"].clone() for p in params] if k > 1 else None
        backward(net, k)
        backward(ref_net, k)
        opt.step()
        ref.step([[p.grad for p in ref_params]])
        if before is None or any(not torch.equal(b, opt.state[p]["exp_avg_sq"])
                                 for b, p in zip(before, params, strict=True)):
            variance.add(k)
        if k > 12 and opt.params_in_sync():
            syncs.add(k)
        for i, (p, q) in enumerate(zip(params, ref_params, strict=True)):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"step {k} param {i}")
            torch.testing.assert_close(opt.state[p]["exp_avg"], ref.m[0][i], rtol=1e-6,
                                       atol=1e-7, msg=f"step {k} exp_avg {i}")
    assert variance == VARIANCE_STEPS and syncs == SYNC_STEPS
    assert opt.state[params[0]]["local_step_interval"] == 4
    assert opt.last_bytes_sent == 0  # one rank: nothing to send


def test_masked_momentum_stays_zero(one_rank_group):
    net = model()
    opt = ZeroOneAdam(groups_of(net), lr=0.01, **HP, **SCHEDULE)
    for k in range(1, 16):
        backward(net, k)
        opt.step()
        if k in SYNC_STEPS:  # m = -u / lrs, u masked (the variance phase masks C(g) only)
            assert torch.all(opt.state[net[2].weight]["exp_avg"][1] == 0), k
    assert torch.all(opt.state[net[2].weight]["exp_avg"][0] != 0)


def test_checkpoint_state_is_shared_and_a_resume_at_a_sync_continues_exactly(one_rank_group):
    net, again = model(), model()
    opt = ZeroOneAdam(groups_of(net), lr=0.01, **HP, **SCHEDULE)
    run(opt, net, range(1, 20))  # k = 19 syncs, then local steps until k = 23
    assert opt.params_in_sync()
    state, errors = opt.state_dict(), {k: v.clone() for k, v in opt.error_state().items()}
    assert set(errors) == {"worker_error", "server_error"}
    for per_param in state["state"].values():
        assert set(per_param) == {"step", "exp_avg", "exp_avg_sq", "var_interval",
                                  "var_counter", "local_step_interval", "local_step_counter"}
    again.load_state_dict(net.state_dict())
    resumed = ZeroOneAdam(groups_of(again), lr=0.01, **HP, **SCHEDULE)
    resumed.load_state_dict(state)
    resumed.load_error_state(errors)
    run(opt, net, range(20, 25))
    run(resumed, again, range(20, 25))
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), again.parameters(),
                                                 strict=True))
    resumed.load_error_state({"worker_error": torch.ones(3)})  # mismatched: zeros
    assert all(t.abs().sum() == 0 for t in resumed.error_state().values())
    opt.load_error_state(None)
    assert all(t.abs().sum() == 0 for t in opt.error_state().values())


def test_the_scripts_mask_wins_over_the_checkpoints(one_rank_group):
    net = model()
    opt = ZeroOneAdam(groups_of(net), lr=0.01, **HP, **SCHEDULE)
    run(opt, net, range(1, 3))
    state = opt.state_dict()
    fresh = ZeroOneAdam([{"params": list(net[0].parameters())}, {"params": [net[2].weight]},
                         {"params": [net[2].bias]}], lr=0.01)
    fresh.load_state_dict(state)
    assert "exp_avg_mask" not in fresh.param_groups[1]
    assert "exp_avg_mask" in state["param_groups"][1]  # the caller's dict is left as it was
    assert torch.equal(fresh.state[net[2].weight]["exp_avg"],
                       opt.state[net[2].weight]["exp_avg"])


def test_a_resume_between_syncs_starts_from_the_saved_parameters(one_rank_group):
    """The local accumulation (u, lrs) is not checkpointed: a resume between syncs continues
    as the reference does from the saved parameters and state with u = 0 and lrs = 0."""
    net, again, ref_net = model(), model(), model()
    opt = ZeroOneAdam(groups_of(net), lr=0.01, **HP, **SCHEDULE)
    run(opt, net, range(1, 18))  # between the syncs of k = 15 and k = 19
    assert not opt.params_in_sync()
    again.load_state_dict(net.state_dict())
    ref_net.load_state_dict(net.state_dict())
    resumed = ZeroOneAdam(groups_of(again), lr=0.01, **HP, **SCHEDULE)
    resumed.load_state_dict(opt.state_dict())
    resumed.load_error_state(opt.error_state())
    assert resumed.params_in_sync()
    ref_params, ref = reference_for(ref_net)
    states = [opt.state[p] for p in (net[0].weight, net[0].bias, net[2].weight, net[2].bias)]
    ref.m[0] = [st["exp_avg"].clone() for st in states]
    ref.v[0] = [st["exp_avg_sq"].clone() for st in states]
    ref.t, ref.frozen = 17 + 1, True  # DeepSpeed's counter after update 17
    ref.var_interval, ref.var_counter = states[0]["var_interval"], states[0]["var_counter"]
    ref.local_interval = states[0]["local_step_interval"]
    ref.local_counter = states[0]["local_step_counter"]
    for k in range(18, 25):
        backward(again, k)
        backward(ref_net, k)
        resumed.step()
        ref.step([[p.grad for p in ref_params]])
    for p, q in zip(again.parameters(), ref_net.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
