"""The MoE layer in one process against a plain-torch loop over tokens: which tokens each
expert keeps under its capacity (random token selection for top-1, position for top-2 and
top-k), where they sit in its buffer, their combine weights, the load-balancing loss and
the counts; experts that are not a Linear stack run one by one with the same result; bad
arguments are one-line errors. (The gating equals DeepSpeed 0.19.8's on random inputs, all
options, dense and sparse: checked by hand against its own functions, see the MoE notes.)"""

from __future__ import annotations

import math

import pytest
import torch

from deepshard.errors import UsageError
from deepshard.moe.gating import dense, route_top2, route_topk
from deepshard.moe.layer import MoE

M, E, S = 6, 4, 13


class Wrapped(torch.nn.Module):
    """An MLP that is not a Sequential: the expert-by-expert path."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(M, 10), torch.nn.GELU(),
                                        torch.nn.Linear(10, M))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.body(x), None


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(M, 10), torch.nn.GELU(), torch.nn.Linear(10, M))


def layer(expert: torch.nn.Module | None = None, **kw) -> MoE:
    moe = MoE(M, expert or mlp(), num_experts=E, min_capacity=0, **kw)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return moe


def expert_out(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    out = moe.deepspeed_moe.experts.deepspeed_experts[e](x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out).squeeze(0)


def reference(moe: MoE, x: torch.Tensor, k: int, capacity: int | None, rts: torch.Tensor | None
              ) -> torch.Tensor:
    """Token by token. An expert keeps the first ``capacity`` routes to it (or, with
    ``rts`` scores, the highest-scoring top-1 tokens); "first" is token order, except that
    top-2 places all first routes before the second ones (DeepSpeed's top-2 positions)."""
    gates = torch.softmax(x @ moe.deepspeed_moe.gate.wg.weight.t(), dim=1)
    chosen = [torch.topk(gates[s], k).indices.tolist() for s in range(S)]
    kept = [[False] * k for _ in range(S)]
    for e in range(E):
        if k == 2:
            routes = [(r, s) for r in range(k) for s in range(S) if chosen[s][r] == e]
        else:
            routes = [(r, s) for s in range(S) for r in range(k) if chosen[s][r] == e]
        if rts is not None:
            routes.sort(key=lambda rs: -rts[rs[1], e].item())
        for r, s in routes[:capacity]:
            kept[s][r] = True
    y = torch.zeros(S, M)
    for s in range(S):
        routes = [r for r in range(k) if kept[s][r]]
        total = sum(gates[s, chosen[s][r]] for r in routes)
        for r in routes:
            e = chosen[s][r]
            weight = gates[s, e] if k == 1 else gates[s, e] / total
            y[s] += weight * expert_out(moe, e, x[s])
    return y


@pytest.mark.parametrize("factor,drop", [(0.5, True), (1.0, True), (2.0, True), (1.0, False)])
@pytest.mark.parametrize("expert", [mlp, Wrapped])
def test_top1_keeps_the_random_token_selection_within_capacity(factor, drop, expert):
    moe = layer(expert(), k=1, capacity_factor=factor, drop_tokens=drop)
    x = torch.randn(S, M, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(9)
    y, l_aux, counts = moe(x)
    torch.manual_seed(9)
    scores = torch.rand(S, E)  # the uniform draw random token selection makes
    capacity = math.ceil(S / E * factor) if drop else None
    torch.testing.assert_close(y, reference(moe, x, 1, capacity, scores), atol=1e-5, rtol=1e-5)
    gates = torch.softmax(x @ moe.deepspeed_moe.gate.wg.weight.t(), dim=1)
    first = torch.nn.functional.one_hot(gates.argmax(1), E)
    assert counts.tolist() == first.sum(0).tolist()
    torch.testing.assert_close(l_aux, (gates.mean(0) * first.float().mean(0)).sum() * E)


@pytest.mark.parametrize("factor,drop", [(0.5, True), (1.0, True), (1.0, False)])
def test_top2_keeps_first_routes_before_second_ones(factor, drop):
    moe = layer(k=2, capacity_factor=factor, drop_tokens=drop, top2_2nd_expert_sampling=False)
    x = torch.randn(S, M, generator=torch.Generator().manual_seed(2)).requires_grad_()
    y, _, counts = moe(x)
    capacity = math.ceil(S / E * factor * 2) if drop else None
    torch.testing.assert_close(y, reference(moe, x, 2, capacity, None), atol=1e-5, rtol=1e-5)
    assert counts.sum().item() == 2 * S
    y.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in moe.parameters())


def test_topk_by_position_and_the_dense_weights():
    moe = layer(k=3)
    x = torch.randn(S, M, generator=torch.Generator().manual_seed(4))
    logits = moe.deepspeed_moe.gate.logits(x)
    _, routes, _ = route_topk(logits, 3, 1.0, 0, drop_policy="position")
    capacity = math.ceil(S / E * 3)
    combine, mask = dense(routes)
    want = reference(moe, x, 3, capacity, None)
    got = torch.zeros(S, M)
    for s, e, c in mask.nonzero().tolist():
        got[s] += combine[s, e, c] * expert_out(moe, e, x[s])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert combine.shape == (S, E, capacity)
    # every used slot holds one token
    assert (mask.sum(0) <= 1).all()


def test_dropless_top2_slots_are_distinct_and_within_the_largest_count():
    logits = torch.randn(S, E, generator=torch.Generator().manual_seed(5))
    _, routes, counts = route_top2(logits, 1.0, 0, drop_tokens=False)
    assert (routes.indices >= 0).all() and routes.capacity == counts.max().item()
    slots = (routes.indices * routes.capacity + routes.locations).reshape(-1)
    assert len(set(slots.tolist())) == 2 * S and (routes.locations < routes.capacity).all()


def test_residual_moe_and_deepspeeds_parameter_names():
    moe = layer(k=1, use_residual=True)
    names = list(moe.state_dict())
    assert names[0] == "deepspeed_moe.gate.wg.weight"
    assert "deepspeed_moe.experts.deepspeed_experts.3.2.bias" in names
    assert names[-6:] == ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias",
                          "coefficient.weight", "coefficient.bias"]
    experts = [p for n, p in moe.named_parameters() if ".deepspeed_experts." in n]
    assert all(p.allreduce is False and p.group_name == "ep_size_1" for p in experts)
    assert not any(hasattr(p, "allreduce") for n, p in moe.named_parameters()
                   if ".deepspeed_experts." not in n)
    x = torch.randn(S, M, generator=torch.Generator().manual_seed(6))
    torch.manual_seed(1)
    y, _, _ = moe(x)
    torch.manual_seed(1)
    sparse = moe.deepspeed_moe(x)
    coef = torch.softmax(moe.coefficient(x), dim=-1)
    torch.testing.assert_close(y, sparse * coef[:, :1] + moe.mlp(x) * coef[:, 1:])


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(UsageError, match="num_experts=3 is not divisible by ep_size=2"):
        MoE(M, mlp(), num_experts=3, ep_size=2)
    with pytest.raises(UsageError, match="noisy_gate_policy='Gaussian'"):
        MoE(M, mlp(), num_experts=2, noisy_gate_policy="Gaussian")
    with pytest.raises(UsageError, match="fewer than min_capacity=4"):
        MoE(M, mlp(), num_experts=2)(torch.randn(3, M))
    with pytest.raises(UsageError, match="has no expert-parallel group yet"):
        MoE(M, mlp(), num_experts=2, ep_size=2)(torch.randn(8, M))
