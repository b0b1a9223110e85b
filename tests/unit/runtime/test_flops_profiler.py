"""The flops profiler against hand-computed counts: 2·batch·in·out FLOPs per Linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepshard.runtime.flops_profiler import FlopsProfiler, render

BATCH = 3


def linear_flops(layer: nn.Linear, batch: int = BATCH) -> int:
    return 2 * batch * layer.in_features * layer.out_features


def linear_params(layer: nn.Linear) -> int:
    return layer.in_features * layer.out_features + layer.out_features


@pytest.fixture
def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(),
                         nn.Sequential(nn.Linear(16, 4), nn.Linear(4, 2)))


def profiled(model: nn.Module, **options):
    profiler = FlopsProfiler(model, **options)
    x = torch.randn(BATCH, 8)
    out = profiler.profile_forward(lambda: model(x))
    return profiler, out, x


def test_flops_and_params_per_module_are_exact(model):
    profiler, out, x = profiled(model)
    rows = {row.name: row for row in profiler.result().modules}
    first, inner0, inner1 = model[0], model[2][0], model[2][1]

    assert list(rows) == ["", "0", "1", "2", "2.0", "2.1"]
    assert rows["0"].flops == linear_flops(first) == 768
    assert rows["2.0"].flops == linear_flops(inner0) == 384
    assert rows["2.1"].flops == linear_flops(inner1) == 48
    assert rows["1"].flops == 0  # ReLU: elementwise ops are not counted
    assert rows["2"].flops == 384 + 48
    assert rows[""].flops == 768 + 384 + 48

    assert rows["0"].params == linear_params(first) == 144
    assert rows["2"].params == linear_params(inner0) + linear_params(inner1) == 78
    assert rows["1"].params == 0
    assert rows[""].params == 222

    assert [rows[n].depth for n in rows] == [0, 1, 1, 1, 2, 2]
    assert [rows[n].type_name for n in rows] == ["Sequential", "Linear", "ReLU",
                                                 "Sequential", "Linear", "Linear"]
    assert all(row.calls == 1 for row in rows.values())
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_totals_and_backward_estimate(model):
    profiler, _, _ = profiled(model, recompute_fwd_factor=1.0)
    profile = profiler.result()
    assert profile.total_params == 222
    assert profile.forward_flops == 1200
    assert profile.backward_flops == (2 + 1.0) * 1200
    assert profile.train_flops == 4 * 1200
    assert profile.backward_latency_s is None and profile.step_latency_s is None


def test_latencies_are_measured_and_nested(model):
    profiler, _, _ = profiled(model)
    profiler.record_backward(0.25)
    profiler.record_step(0.125)
    profile = profiler.result()
    rows = {row.name: row for row in profile.modules}
    assert all(row.latency_s >= 0 for row in profile.modules)
    assert rows[""].latency_s > 0
    assert rows[""].latency_s <= profile.forward_latency_s
    assert rows["2"].latency_s >= rows["2.0"].latency_s + rows["2.1"].latency_s
    assert rows[""].latency_s >= rows["0"].latency_s + rows["2"].latency_s
    assert profile.backward_latency_s == 0.25 and profile.step_latency_s == 0.125


def test_hooks_are_removed_and_each_call_replaces_the_record(model):
    profiler, _, _ = profiled(model)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    x = torch.randn(2 * BATCH, 8)
    profiler.profile_forward(lambda: model(x))
    assert profiler.result().forward_flops == 2 * 1200


def test_container_never_called_sums_its_children_and_shared_module_counts_each_call():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.layers[0](x)  # layers.0 runs twice

    net = Net()
    profiler = FlopsProfiler(net)
    profiler.profile_forward(lambda: net(torch.randn(BATCH, 4)))
    rows = {row.name: row for row in profiler.result().modules}
    one = 2 * BATCH * 4 * 4
    assert rows["layers.0"].calls == 2 and rows["layers.0"].flops == 2 * one
    assert rows["layers"].calls == 0 and rows["layers"].flops == 3 * one
    assert rows["layers"].latency_s == pytest.approx(
        rows["layers.0"].latency_s + rows["layers.1"].latency_s)
    assert rows["layers"].params == 2 * 20


def test_attention_on_cpu_is_counted():
    b, h, s, d = 2, 4, 16, 8
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    attention = nn.Identity()  # a module to run the op under
    profiler = FlopsProfiler(attention)
    profiler.profile_forward(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    # torch's formula: q @ k^T and scores @ v, causal mask ignored
    assert profiler.result().forward_flops == 2 * (2 * b * h * s * s * d)


def test_render_contains_totals_and_every_module(model):
    profiler, _, _ = profiled(model)
    profiler.record_backward(0.002)
    profiler.record_step(0.001)
    text = render(profiler.result())
    lines = text.splitlines()
    assert any(line.startswith("params:") and line.endswith(" 222") for line in lines)
    assert any(line.startswith("fwd FLOPs:") and line.endswith(" 1.20 K") for line in lines)
    assert any(line.startswith("fwd+bwd FLOPs = 3 x fwd FLOPs:") and line.endswith(" 3.60 K")
               for line in lines)
    assert any(line.startswith("fwd MACs") and line.endswith(" 600 MACs") for line in lines)
    for label in ("fwd latency:", "bwd latency:", "step latency:", "iter latency"):
        assert any(line.startswith(label) for line in lines), label
    tree = lines[lines.index(next(x for x in lines if x.startswith("Module tree"))) + 1:]
    for name, kind, share in (("(model)", "Sequential", "100.00%"), ("0", "Linear", "64.00%"),
                              ("1", "ReLU", "0.00%"), ("2", "Sequential", "36.00%"),
                              ("2.0", "Linear", "32.00%"), ("2.1", "Linear", "4.00%")):
        line = next(x for x in tree if x.strip().startswith(f"{name} ({kind}):"))
        assert f"= {share} MACs" in line, line
    assert "depth 2:" in text


def test_render_limits_depth_and_top_modules(model):
    profiler, _, _ = profiled(model)
    shallow = render(profiler.result(), module_depth=1, top_modules=1)
    assert "depth 1:" in shallow and "depth 2:" not in shallow
    assert "2.0 (Linear)" not in shallow and "  2 (Sequential)" in shallow
    params_line = shallow.splitlines()[shallow.splitlines().index("depth 1:") + 1]
    assert params_line.strip() == "params      - Linear: 144"

    wide = render(profiler.result(), module_depth=-1, top_modules=3)
    params_line = wide.splitlines()[wide.splitlines().index("depth 1:") + 1]
    assert params_line.strip() == "params      - Linear: 144, Sequential: 78, ReLU: 0"
    macs_line = wide.splitlines()[wide.splitlines().index("depth 2:") + 2]
    assert macs_line.strip() == "MACs        - Linear: 216 MACs"

    summary = FlopsProfiler(model, detailed=False)
    summary.profile_forward(lambda: model(torch.randn(BATCH, 8)))
    assert "Module tree" not in summary.summary()


def test_result_before_profiling_is_an_error(model):
    with pytest.raises(RuntimeError, match="before profile_forward"):
        FlopsProfiler(model).result()
