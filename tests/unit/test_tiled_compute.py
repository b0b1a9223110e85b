"""ALST's tiled MLP and tiled logits + loss against the plain computation: same values and
gradients (fp64), less peak memory (torch's profiler), DeepSpeed's ``apply`` signatures."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from deepshard.errors import UsageError
from deepshard.sequence.fused_ce import fusable
from deepshard.sequence.tiled import TiledFusedLogitsLoss, TiledMLP, tiled_logits_loss, tiled_mlp


def peak_bytes(fn) -> int:
    """Peak of the CPU bytes allocated and not yet freed while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = top = 0
    for e in events:
        live += e.nbytes()
        top = max(top, live)
    return top


class GatedMLP(torch.nn.Module):
    """Llama's MLP."""

    def __init__(self, hidden=8, inner=24, bias=False):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inner, bias=bias)
        self.up_proj = torch.nn.Linear(hidden, inner, bias=bias)
        self.down_proj = torch.nn.Linear(inner, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def grads(module, *tensors):
    return [t.grad.clone() for t in tensors] + [p.grad.clone() for p in module.parameters()]


def run(module, x, compute):
    module.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    out = compute(module, x)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weight).sum().backward()
    return out.detach(), grads(module, x)


@pytest.mark.parametrize("shape,shards", [((2, 13, 8), 4), ((29, 8), 3), ((1, 7, 8), 7)])
def test_tiled_mlp_equals_the_mlp(shape, shards):
    torch.manual_seed(0)
    mlp = GatedMLP(bias=True).double()
    x = torch.randn(*shape, dtype=torch.float64)
    want, want_grads = run(mlp, x, lambda m, t: m(t))
    got, got_grads = run(mlp, x, lambda m, t: tiled_mlp(m, t, shards))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_tiled_mlp_delivers_each_parameter_gradient_once():
    mlp = GatedMLP()
    seen = {id(p): 0 for p in mlp.parameters()}
    for p in mlp.parameters():
        p.register_post_accumulate_grad_hook(lambda q: seen.__setitem__(id(q), seen[id(q)] + 1))
    tiled_mlp(mlp, torch.randn(2, 16, 8, requires_grad=True), shards=4).sum().backward()
    assert set(seen.values()) == {1}


def test_tiled_mlp_keeps_only_its_input_for_backward():
    mlp = GatedMLP(hidden=16, inner=256)
    x = torch.randn(1, 512, 16, requires_grad=True)
    plain = peak_bytes(lambda: mlp(x).sum().backward())
    tiled = peak_bytes(lambda: tiled_mlp(mlp, x, shards=8).sum().backward())
    intermediate = 512 * 256 * 4
    assert plain > 4 * intermediate  # gate, up, silu, product kept for backward
    assert tiled < plain / 3, (tiled, plain)


def test_deepspeed_tiled_mlp_apply():
    torch.manual_seed(1)
    mlp = GatedMLP().double()
    x = torch.randn(2, 9, 8, dtype=torch.float64)

    def fn(self, t):
        return self.down_proj(F.silu(self.gate_proj(t)) * self.up_proj(t))

    params = list(mlp.parameters())
    want, want_grads = run(mlp, x, lambda m, t: m(t))
    got, got_grads = run(mlp, x, lambda m, t: TiledMLP.apply(fn, m, t, 3, params))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    with pytest.raises(UsageError, match="not one of the module's"):
        TiledMLP.apply(fn, mlp, x, 3, [torch.nn.Parameter(torch.ones(1))])


def loss_case(seed=0, tokens=(3, 11), hidden=6, vocab=50):
    torch.manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=True).double()
    x = torch.randn(*tokens, hidden, dtype=torch.float64)
    labels = torch.randint(0, vocab, tokens)
    labels[0, :4] = -100
    labels[2, -1] = -100
    return head, x, labels


def loss_and_grads(head, x, compute):
    head.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    loss = compute(x)
    (3.0 * loss).backward()
    return loss.detach(), grads(head, x)


@pytest.mark.parametrize("shards", [1, 4, 33])
@pytest.mark.parametrize("num_items", [None, 40])
def test_tiled_logits_loss_equals_cross_entropy(shards, num_items):
    head, x, labels = loss_case()

    def plain(t):
        total = F.cross_entropy(head(t).flatten(0, 1), labels.flatten(), reduction="sum")
        count = (labels != -100).sum() if num_items is None else num_items
        return total / count

    want, want_grads = loss_and_grads(head, x, plain)
    got, got_grads = loss_and_grads(head, x, lambda t: tiled_logits_loss(
        t, head, labels, shards=shards, num_items_in_batch=num_items))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_a_head_with_hooks_or_under_autocast_goes_through_autograd_alike():
    """The hand-differentiated path (a plain Linear) and the autograd one (a head with a
    hook, as ZeRO-3 gathers it; or under autocast) agree with the plain loss."""
    head, x, labels = loss_case(seed=1)
    assert fusable(head, x)
    want, want_grads = loss_and_grads(head, x, lambda t: F.cross_entropy(
        head(t).flatten(0, 1), labels.flatten()))
    handle = head.register_forward_pre_hook(lambda module, args: None)
    assert not fusable(head, x)
    got, got_grads = loss_and_grads(head, x, lambda t: tiled_logits_loss(
        t, head, labels, shards=4))
    handle.remove()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fusable(head, x)


def test_bf16_head_matches_autograd_in_its_own_dtype():
    head, x, labels = loss_case(seed=3)
    head, x = head.to(torch.bfloat16), x.to(torch.bfloat16)
    want, want_grads = loss_and_grads(head, x, lambda t: F.cross_entropy(
        head(t).float().flatten(0, 1), labels.flatten()))
    got, got_grads = loss_and_grads(head, x, lambda t: tiled_logits_loss(
        t, head, labels, shards=3))
    assert got.dtype == torch.float32 and got_grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def test_tiled_logits_loss_without_grad_and_bad_labels():
    head, x, labels = loss_case()
    with torch.no_grad():
        got = tiled_logits_loss(x, head, labels, shards=5)
    want = F.cross_entropy(head(x).flatten(0, 1), labels.flatten())
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-6, atol=0)
    with pytest.raises(UsageError, match="do not match"):
        tiled_logits_loss(x, head, labels[:, 1:])


def test_tiled_logits_loss_never_holds_the_whole_logits():
    head = torch.nn.Linear(16, 4000)
    x = torch.randn(2000, 16, requires_grad=True)
    y = torch.randint(0, 4000, (2000,))
    logits = 2000 * 4000 * 4
    plain = peak_bytes(lambda: F.cross_entropy(head(x), y).backward())
    tiled = peak_bytes(lambda: tiled_logits_loss(x, head, y, shards=8).backward())
    assert plain >= 2 * logits
    assert tiled < logits / 2, (tiled, logits)


def test_deepspeed_tiled_fused_logits_loss_apply():
    head, x, labels = loss_case(seed=2)
    mask = (labels != -100).long()

    def fn(self, t, y, m):
        per = F.cross_entropy(self(t).float(), y.clamp(min=0), reduction="none")
        return (per * m).sum() / m.sum().clamp(min=1)

    def reference(t):  # DeepSpeed's "mean": the mean of the tiles' results
        flat, y, m = t.flatten(0, 1), labels.flatten(), mask.flatten()
        parts = [fn(head, a, b, c) for a, b, c in zip(flat.chunk(3), y.chunk(3), m.chunk(3),
                                                       strict=True)]
        return torch.stack(parts).mean()

    want, want_grads = loss_and_grads(head, x, reference)
    got, got_grads = loss_and_grads(head, x, lambda t: TiledFusedLogitsLoss.apply(
        fn, head, t, labels, mask, 3, [head.weight], "mean"))
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-12)
    with pytest.raises(UsageError, match="output_reduction"):
        TiledFusedLogitsLoss.apply(fn, head, x, labels, mask, 3, None, "max")
