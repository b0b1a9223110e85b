"""OneBitAdam in one process (a one-rank group): DeepSpeed's OnebitAdam update in warm-up and
after the freeze, the engine protocol, checkpoint state, masks and argument errors."""

from __future__ import annotations

import pytest
import torch

from deepshard.runtime.optim.onebit.adam import OneBitAdam
from tests.unit.runtime.optim.onebit.reference import ReferenceOneBitAdam


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def backward(net: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    net.zero_grad()
    net(torch.randn(7, 5, generator=gen)).square().sum().backward()


HP = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)


def test_warm_up_and_frozen_steps_follow_deepspeeds_update(one_rank_group):
    net, ref_net = model(), model()
    opt = OneBitAdam(net.parameters(), freeze_step=4, **HP)
    ref = ReferenceOneBitAdam([list(ref_net.parameters())], freeze_step=4, **HP)
    seen = []
    for step in range(8):
        seen.append(opt.communicates_next_step())
        backward(net, step)
        backward(ref_net, step)
        opt.step()
        ref.step([[p.grad for p in ref_net.parameters()]])
        for p, q in zip(net.parameters(), ref_net.parameters(), strict=True):
            assert torch.equal(p, q), step
    assert seen == [False] * 4 + [True] * 4
    assert opt.last_bytes_sent == 0  # one rank: nothing to send
    sq = [opt.state[p]["exp_avg_sq"].clone() for p in net.parameters()]
    backward(net, 99)
    opt.step()
    assert all(torch.equal(a, opt.state[p]["exp_avg_sq"])
               for a, p in zip(sq, net.parameters(), strict=True))  # frozen


def test_bias_correction_and_eps_inside_sqrt_do_not_change_the_update(one_rank_group):
    nets = [model(), model()]
    opts = [OneBitAdam(nets[0].parameters(), freeze_step=2),
            OneBitAdam(nets[1].parameters(), freeze_step=2, bias_correction=False,
                       eps_inside_sqrt=True)]
    for step in range(4):
        for net, opt in zip(nets, opts, strict=True):
            backward(net, step)
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(nets[0].parameters(), nets[1].parameters(),
                                                 strict=True))


def test_momenta_are_views_of_one_flat_buffer_and_state_dict_holds_shared_state(
        one_rank_group):
    net = model()
    opt = OneBitAdam(net.parameters(), freeze_step=1)
    backward(net, 0)
    opt.step()
    storages = {opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in net.parameters()}
    assert len(storages) == 1
    state = opt.state_dict()["state"]
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in state.values())
    assert opt.error_state() == {}  # one rank: no compressed all-reduce, no errors


def test_load_state_dict_rebuilds_the_flat_buffer_and_continues_identically(one_rank_group):
    net, other = model(), model(1)
    opt = OneBitAdam(net.parameters(), freeze_step=2, **HP)
    for step in range(3):
        backward(net, step)
        opt.step()
    other.load_state_dict(net.state_dict())
    opt2 = OneBitAdam(other.parameters(), freeze_step=2, **HP)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.communicates_next_step() and opt2.steps_done() == 3
    exp_avgs = [opt2.state[p]["exp_avg"] for p in other.parameters()]
    assert len({m.untyped_storage().data_ptr() for m in exp_avgs}) == 1
    assert all(m.untyped_storage().data_ptr() != opt.state[p]["exp_avg"].untyped_storage()
               .data_ptr() for m, p in zip(exp_avgs, net.parameters(), strict=True))
    for step in range(3, 6):
        for n, o in ((net, opt), (other, opt2)):
            backward(n, step)
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), other.parameters(),
                                                 strict=True))


def test_error_state_of_the_wrong_size_resets_to_zero(one_rank_group):
    net = model()
    opt = OneBitAdam(net.parameters(), freeze_step=0)
    opt.load_error_state({"worker_error": torch.ones(3), "server_error": torch.ones(3)})
    assert opt.error_state() == {}
    n = opt._reducer().padded_numel(sum(p.numel() for p in net.parameters()))
    opt.load_error_state({"worker_error": torch.ones(n), "server_error": torch.full((n,), 2.0)})
    assert torch.equal(opt.error_state()["server_error"], torch.full((n,), 2.0))
    opt.load_error_state(None)
    assert opt.error_state() == {}


def test_exp_avg_mask_multiplies_the_momentum_after_the_freeze(one_rank_group):
    net = model()
    weight, bias = net[0].weight, net[0].bias
    mask = torch.ones_like(weight)
    mask[1:] = 0
    groups = [{"params": [weight, bias], "exp_avg_mask": [mask, torch.ones_like(bias)]},
              {"params": list(net[2].parameters())}]
    opt = OneBitAdam(groups, freeze_step=1)
    for step in range(3):
        backward(net, step)
        opt.step()
    assert opt.state[weight]["exp_avg"][1:].abs().sum() == 0
    assert opt.state[weight]["exp_avg"][0].abs().sum() > 0
    assert opt.state[bias]["exp_avg"].abs().sum() > 0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"amsgrad": True}, "AMSGrad"), ({"lr": -1.0}, "lr"), ({"freeze_step": -1}, "freeze_step"),
    ({"betas": (0.9, 1.0)}, "betas"), ({"eps": -1.0}, "eps"),
    ({"comm_backend_name": "nccI"}, "comm_backend_name"),
])
def test_bad_arguments_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OneBitAdam(model().parameters(), **kwargs)


def test_a_param_group_added_later_joins_the_flat_buffer(one_rank_group):
    net = model()
    opt = OneBitAdam(list(net[0].parameters()), freeze_step=1)
    backward(net, 0)
    opt.step()
    before = opt.state[net[0].weight]["exp_avg"].clone()
    opt.add_param_group({"params": list(net[2].parameters())})
    backward(net, 1)
    grad = net[0].weight.grad.clone()
    opt.step()
    exp_avgs = [opt.state[p]["exp_avg"] for p in net.parameters()]
    assert len({m.untyped_storage().data_ptr() for m in exp_avgs}) == 1
    torch.testing.assert_close(opt.state[net[0].weight]["exp_avg"], 0.9 * before + 0.1 * grad)
    assert opt.state[net[2].weight]["exp_avg"].abs().sum() > 0
