"""The ``flops_profiler`` config section: per-module parameters, FLOPs and latency of a forward.

DeepSpeed patches ``torch.nn.functional`` with its own FLOP formulas; we count with torch's
:class:`torch.utils.flop_counter.FlopCounterMode` instead and add only what it lacks: the
split by module (read off the counter's running total in forward pre/post hooks, so it
does not depend on the counter's module naming) and the wall-clock latency per module.

The engine wraps one forward at ``profile_step`` in :meth:`FlopsProfiler.profile_forward`,
adds the backward and optimizer-step times it measured with :meth:`~FlopsProfiler.
record_backward` / :meth:`~FlopsProfiler.record_step`, and logs :func:`render` of
:meth:`~FlopsProfiler.result` (or writes it to ``output_file``). Backward FLOPs are not
counted but estimated, as DeepSpeed does: ``(2 + recompute_fwd_factor) x`` the forward's.

Counts are torch's: 2 FLOPs per multiply-accumulate for matmuls and convolutions, attention
counted as if not causal, and elementwise ops (norms, activations, softmax) not counted.
Latencies are measured during the counted forward, so they include the counter's Python
work per op (a small model on CPU runs 2-3x slower under it); the backward and step times
the engine records are unaffected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

T = TypeVar("T")


@dataclass(frozen=True)
class ModuleProfile:
    """One module's share of the profiled forward; FLOPs and latency include its children."""

    name: str
    """Qualified name in the model (``blocks.0.qkv``); ``""`` for the model itself."""
    depth: int
    """0 for the model, 1 for its children, and so on."""
    params: int
    """Parameters of the module and its children (shared parameters counted once)."""
    flops: int
    """Forward FLOPs of all its calls; for a module never called (a ``ModuleList``), the sum
    over its children."""
    latency_s: float
    """Wall-clock seconds of all its calls (or the sum over its children, as for ``flops``)."""
    type_name: str
    """The module's class name (``Linear``)."""
    calls: int
    """How many times its forward ran."""


@dataclass(frozen=True)
class FlopsProfile:
    """The result of one profiled forward, plus the step timings the caller recorded."""

    total_params: int
    forward_flops: int
    """Every FLOP counted while the profiled callable ran (the loss too, when it ran inside)."""
    forward_latency_s: float
    modules: tuple[ModuleProfile, ...]
    """Every module of the model, in ``named_modules`` (tree) order."""
    recompute_fwd_factor: float = 0.0
    """Share of the forward recomputed in backward (1.0 with full activation checkpointing)."""
    backward_latency_s: float | None = None
    step_latency_s: float | None = None

    @property
    def backward_flops(self) -> float:
        """Estimated: a backward costs twice the forward, plus any recomputed forward."""
        return (2.0 + self.recompute_fwd_factor) * self.forward_flops

    @property
    def train_flops(self) -> float:
        """Forward plus estimated backward FLOPs of one micro-batch."""
        return self.forward_flops + self.backward_flops


class FlopsProfiler:
    """Profiles one forward of ``module`` and renders it like DeepSpeed's flops profiler.

    Args:
        module: the model; every submodule gets a row.
        module_depth: deepest level shown by :meth:`summary` (-1: all).
        top_modules: modules listed per depth in the aggregated view of :meth:`summary`.
        detailed: whether :meth:`summary` includes the per-module tree.
        recompute_fwd_factor: share of the forward recomputed in backward, for the
            backward FLOPs estimate.
    """

    def __init__(self, module: nn.Module, *, module_depth: int = -1, top_modules: int = 1,
                 detailed: bool = True, recompute_fwd_factor: float = 0.0):
        self.module = module
        self.module_depth = module_depth
        self.top_modules = top_modules
        self.detailed = detailed
        self.recompute_fwd_factor = recompute_fwd_factor
        self._forward: tuple[int, float, dict[nn.Module, _Tally]] | None = None
        self._backward_s: float | None = None
        self._step_s: float | None = None

    def profile_forward(self, run: Callable[[], T]) -> T:
        """Run ``run()`` (the model's forward) under the counter and return its result.

        Each call replaces the previous record: one micro-batch is profiled, as in DeepSpeed.
        """
        _warm_up_counter()
        stats = {m: _Tally() for m in self.module.modules()}
        counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS)
        sync = torch.cuda.synchronize if torch.cuda.is_initialized() else None
        handles = []
        for mod in stats:
            handles.append(mod.register_forward_pre_hook(_pre_hook(stats[mod], counter, sync)))
            handles.append(mod.register_forward_hook(_post_hook(stats[mod], counter, sync),
                                                     always_call=True))
        try:
            with counter:
                if sync:
                    sync()
                start = time.perf_counter()
                out = run()
                if sync:
                    sync()
                elapsed = time.perf_counter() - start
        finally:
            for handle in handles:
                handle.remove()
        self._forward = (counter.get_total_flops(), elapsed, stats)
        return out

    def record_backward(self, seconds: float) -> None:
        """The measured backward time of the profiled micro-batch."""
        self._backward_s = seconds

    def record_step(self, seconds: float) -> None:
        """The measured optimizer-step time of the profiled step."""
        self._step_s = seconds

    def result(self) -> FlopsProfile:
        """The profile of the last :meth:`profile_forward`."""
        if self._forward is None:
            raise RuntimeError("FlopsProfiler.result() called before profile_forward()")
        total_flops, elapsed, stats = self._forward
        rows = _module_rows(self.module, stats)
        return FlopsProfile(total_params=rows[0].params, forward_flops=total_flops,
                            forward_latency_s=elapsed, modules=rows,
                            recompute_fwd_factor=self.recompute_fwd_factor,
                            backward_latency_s=self._backward_s, step_latency_s=self._step_s)

    def summary(self) -> str:
        """:func:`render` of :meth:`result` with this profiler's display settings."""
        return render(self.result(), module_depth=self.module_depth,
                      top_modules=self.top_modules, detailed=self.detailed)


def _cpu_flash_attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None,
                              **kwargs) -> int:
    # torch registers its SDPA formula for the CUDA kernels only; the CPU kernel has the
    # same (query, key, value, ...) signature, so the same formula applies.
    return sdpa_flop_count(query_shape, key_shape, value_shape)


_EXTRA_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
                   _cpu_flash_attention_flop}


def _warm_up_counter() -> None:
    # the first op under any FlopCounterMode in a process pays ~2 s of one-time setup;
    # pay it here, outside the timed region
    tiny = torch.ones(1, 1)
    with FlopCounterMode(display=False):
        torch.mm(tiny, tiny)


@dataclass(slots=True)
class _Tally:
    """One module's running totals during a profiled forward."""

    calls: int = 0
    flops: int = 0
    seconds: float = 0.0
    # (counter total, time) at each entry not yet exited: a stack, because a module may
    # be re-entered (a shared block called from inside itself)
    open: list[tuple[int, float]] = field(default_factory=list)


def _pre_hook(tally: _Tally, counter: FlopCounterMode, sync: Callable[[], None] | None):
    def hook(module, args):
        if sync:
            sync()
        tally.open.append((counter.get_total_flops(), time.perf_counter()))
    return hook


def _post_hook(tally: _Tally, counter: FlopCounterMode, sync: Callable[[], None] | None):
    def hook(module, args, output):
        if sync:
            sync()
        flops0, start = tally.open.pop()
        tally.calls += 1
        tally.flops += counter.get_total_flops() - flops0
        tally.seconds += time.perf_counter() - start
    return hook


def _module_rows(root: nn.Module, stats: dict[nn.Module, _Tally]) -> tuple[ModuleProfile, ...]:
    def measure(module: nn.Module) -> tuple[int, float]:
        tally = stats[module]
        if tally.calls:
            return tally.flops, tally.seconds
        inner = [measure(child) for child in module.children()]
        return sum(f for f, _ in inner), sum(s for _, s in inner)

    rows = []
    for name, module in root.named_modules():
        flops, seconds = measure(module)
        rows.append(ModuleProfile(
            name=name, depth=name.count(".") + 1 if name else 0,
            params=sum(p.numel() for p in module.parameters()), flops=flops,
            latency_s=seconds, type_name=type(module).__name__, calls=stats[module].calls))
    return tuple(rows)


def render(profile: FlopsProfile, *, module_depth: int = -1, top_modules: int = 1,
           detailed: bool = True) -> str:
    """A text report like DeepSpeed's: totals, top modules per depth, then the module tree.

    Args:
        module_depth: deepest level shown in both views (-1: all levels).
        top_modules: how many module types each depth lists by params, FLOPs and latency
            (modules of one class at one depth are summed, as in DeepSpeed).
        detailed: whether to include the per-module tree.
    """
    max_depth = max(row.depth for row in profile.modules)
    depth = max_depth if module_depth < 0 else min(module_depth, max_depth)
    lines = ["-------------------------- deepshard flops profiler --------------------------",
             *_totals(profile), "",
             f"Top {top_modules} modules by params, MACs and fwd latency at each depth:"]
    for level in range(depth + 1):
        lines.extend(_top_at_depth(profile, level, top_modules))
    if detailed:
        lines += ["", "Module tree (params, MACs, fwd latency: own value = % of total, "
                      "achieved fwd FLOPS):"]
        lines.extend(_tree_line(profile, row) for row in profile.modules if row.depth <= depth)
    lines.append("-" * 78)
    return "\n".join(lines)


def _totals(p: FlopsProfile) -> list[str]:
    r = p.recompute_fwd_factor
    bwd_factor, fwd = 2.0 + r, p.forward_flops
    rows = [
        ("params", _si(p.total_params)),
        ("fwd MACs (torch counts 2 FLOPs per MAC)", _si(fwd / 2, "MACs")),
        ("fwd FLOPs", _si(fwd)),
        (f"fwd+bwd FLOPs = {bwd_factor + 1:g} x fwd FLOPs", _si(p.train_flops)),
        ("fwd latency", _seconds(p.forward_latency_s)),
        ("fwd FLOPS = fwd FLOPs / fwd latency", _rate(fwd, p.forward_latency_s)),
    ]
    if p.backward_latency_s is not None:
        fwd_bwd_s = p.forward_latency_s + p.backward_latency_s
        rows += [("bwd latency", _seconds(p.backward_latency_s)),
                 (f"bwd FLOPS = {bwd_factor:g} x fwd FLOPs / bwd latency",
                  _rate(p.backward_flops, p.backward_latency_s)),
                 (f"fwd+bwd FLOPS = {bwd_factor + 1:g} x fwd FLOPs / (fwd+bwd latency)",
                  _rate(p.train_flops, fwd_bwd_s))]
        if p.step_latency_s is not None:
            iter_s = fwd_bwd_s + p.step_latency_s
            rows += [("step latency", _seconds(p.step_latency_s)),
                     ("iter latency = fwd + bwd + step", _seconds(iter_s)),
                     (f"FLOPS = {bwd_factor + 1:g} x fwd FLOPs / iter latency",
                      _rate(p.train_flops, iter_s))]
    elif p.step_latency_s is not None:
        rows.append(("step latency", _seconds(p.step_latency_s)))
    width = max(len(label) for label, _ in rows) + 2
    return [f"{label + ':':<{width}}{value}" for label, value in rows]


def _top_at_depth(p: FlopsProfile, level: int, top: int) -> list[str]:
    by_type: dict[str, list[float]] = {}
    for row in p.modules:
        if row.depth == level:
            agg = by_type.setdefault(row.type_name, [0, 0, 0.0])
            agg[0] += row.params
            agg[1] += row.flops
            agg[2] += row.latency_s

    def best(i: int, fmt: Callable[[float], str]) -> str:
        ranked = sorted(by_type.items(), key=lambda item: item[1][i], reverse=True)[:top]
        return ", ".join(f"{name}: {fmt(values[i])}" for name, values in ranked)

    return [f"depth {level}:",
            f"    params      - {best(0, _si)}",
            f"    MACs        - {best(1, lambda f: _si(f / 2, 'MACs'))}",
            f"    fwd latency - {best(2, _seconds)}"]


def _tree_line(p: FlopsProfile, row: ModuleProfile) -> str:
    label = f"{row.name or '(model)'} ({row.type_name})"
    return (f"{'  ' * row.depth}{label}: "
            f"{_si(row.params)} = {_pct(row.params, p.total_params)} params, "
            f"{_si(row.flops / 2, 'MACs')} = {_pct(row.flops, p.forward_flops)} MACs, "
            f"{_seconds(row.latency_s)} = {_pct(row.latency_s, p.forward_latency_s)} latency, "
            f"{_rate(row.flops, row.latency_s)}")


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0%"


def _si(value: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}".rstrip()
    return f"{value:g} {unit}".rstrip()


def _rate(flops: float, seconds: float) -> str:
    return _si(flops / seconds, "FLOPS") if seconds > 0 else "n/a"


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.2f} us"
