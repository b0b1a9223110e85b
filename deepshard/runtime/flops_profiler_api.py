"""DeepSpeed's flops profiler API — ``FlopsProfiler.start_profile()`` ... ``stop_profile()``,
``get_total_flops/macs/params/duration``, ``print_model_profile`` and ``get_model_profile`` —
over :class:`deepshard.runtime.flops_profiler.FlopsProfiler`, which counts with torch's
``FlopCounterMode`` and renders the report.

Counts differ from DeepSpeed's where its formulas do: MACs are the same for matmuls and
convolutions (torch counts 2 FLOPs per MAC, so MACs = FLOPs / 2), while DeepSpeed's FLOPs
also count elementwise work (activations, biases added by convolutions, norms, softmax),
which torch leaves out. The strings are DeepSpeed's (``"6.27 K"``, ``"3.07 KMACs"``, ``"808"``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from deepshard.runtime import flops_profiler as rt

__all__ = ["FlopsProfiler", "duration_to_string", "flops_to_string", "get_model_profile",
           "macs_to_string", "number_to_string", "params_to_string"]

logger = logging.getLogger("deepshard")
DEFAULT_PRECISION = 2
_MAGNITUDES = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}


class FlopsProfiler(rt.FlopsProfiler):
    """DeepSpeed's ``FlopsProfiler(model)``: everything the model runs between
    :meth:`start_profile` and :meth:`stop_profile` is counted (several forwards add up).

    ``ds_engine`` is accepted and not used; ``recompute_fwd_factor`` feeds the backward
    estimate of the printed profile. Modules whose type is in ``ignore_list`` get no row of
    their own (their work counts in their parent, as in DeepSpeed).
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0):
        super().__init__(model, recompute_fwd_factor=recompute_fwd_factor)
        self.model, self.ds_engine = model, ds_engine
        self.started = False
        self._session: contextlib.ExitStack | None = None
        self._live: tuple[FlopCounterMode, dict, float] | None = None
        self._ignored: tuple[type, ...] = ()

    # -- DeepSpeed's lifecycle ----------------------------------------------------------
    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Start counting: hooks on every module (but those of ``ignore_list``'s types)
        and torch's FLOP counter around whatever runs until :meth:`stop_profile`."""
        self.end_profile()
        rt._warm_up_counter()
        self._ignored = ignored = tuple(ignore_list or ())
        stats = {m: rt._Tally() for m in self.model.modules()}
        counter = FlopCounterMode(display=False, custom_mapping=rt._EXTRA_FORMULAS)
        sync = torch.cuda.synchronize if torch.cuda.is_initialized() else None
        session = contextlib.ExitStack()
        for mod, tally in stats.items():
            if isinstance(mod, ignored):
                continue
            session.enter_context(mod.register_forward_pre_hook(
                rt._pre_hook(tally, counter, sync)))
            session.enter_context(mod.register_forward_hook(
                rt._post_hook(tally, counter, sync), always_call=True))
        session.enter_context(counter)
        self._session, self.started = session, True
        self._live = (counter, stats, time.perf_counter())

    def stop_profile(self) -> None:
        """Stop counting (the counts stay readable until :meth:`end_profile`)."""
        if self._session is None or self._live is None:
            return
        counter, stats, start = self._live
        self._session.close()
        self._session, self._live = None, None
        self._forward = (counter.get_total_flops(), time.perf_counter() - start, stats)

    def reset_profile(self) -> None:
        """Zero the counts of a running profile."""
        if self._session is not None:
            self.start_profile(self._ignored)

    def end_profile(self) -> None:
        """Stop, and drop the counts."""
        self.stop_profile()
        self._forward = None
        self.started = False

    # -- totals ----------------------------------------------------------------------------
    def _model_row(self) -> rt.ModuleProfile:
        if self._forward is None:
            raise RuntimeError("the profiler has counted nothing: call start_profile(), run "
                               "the model, then stop_profile()")
        return self.result().modules[0]

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """FLOPs of the model's forwards (torch's count: 2 per multiply-accumulate)."""
        flops = self._model_row().flops
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Multiply-accumulates of the model's forwards."""
        macs = self._model_row().flops // 2
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds spent in the model's forwards."""
        seconds = self._model_row().latency_s
        return duration_to_string(seconds) if as_string else seconds

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model (shared ones once)."""
        params = self._model_row().params
        return params_to_string(params) if as_string else params

    # -- reports ----------------------------------------------------------------------------
    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1,
                            top_modules: int = 1, detailed: bool = True,
                            output_file: str | None = None) -> None:
        """Print the report (:func:`deepshard.runtime.flops_profiler.render`) to stdout, or
        write it to ``output_file``."""
        text = (f"Profile at step {profile_step}:\n"
                + rt.render(self.result(), module_depth=module_depth,
                            top_modules=top_modules, detailed=detailed))
        if output_file is None:
            print(text)
        else:
            with open(output_file, "w") as f:
                f.write(text + "\n")

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print the totals and the top modules per depth, without the module tree."""
        print(rt.render(self.result(), module_depth=module_depth, top_modules=top_modules,
                        detailed=False))


def get_model_profile(model: nn.Module, input_shape: tuple[int, ...] | None = None,
                      args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                      print_profile: bool = True, detailed: bool = True, module_depth: int = -1,
                      top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Sequence[type] | None = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """``(flops, macs, params)`` of one forward (or ``generate``) of ``model`` in eval mode,
    after ``warm_up`` unprofiled runs, as DeepSpeed's ``get_model_profile`` returns them:
    strings such as ``("6.27 K", "3.07 KMACs", "808")`` when ``as_string``, else ints.

    The input is ``args``/``kwargs``, or, with ``input_shape``, one uninitialised tensor of
    that shape in the model's parameter dtype and device (as DeepSpeed makes it).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode must be 'forward' or 'generate', got {mode!r}")
    args, kwargs = list(args), dict(kwargs or {})
    if input_shape is not None:
        args = [_input(model, input_shape)]
    if not args and not kwargs:
        raise ValueError("give input_shape, or the model's inputs as args and/or kwargs")
    run: Callable[..., Any] = model if mode == "forward" else model.generate
    prof = FlopsProfiler(model)
    model.eval()
    for _ in range(warm_up):
        run(*args, **kwargs)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        run(*args, **kwargs)
    finally:
        prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth,
                                 top_modules=top_modules, detailed=detailed,
                                 output_file=output_file)
    prof.end_profile()
    if as_string:
        # as numbers: get_total_*() without as_string
        return (number_to_string(cast(int, flops)), macs_to_string(cast(int, macs)),
                params_to_string(cast(int, params)))
    return flops, macs, params


def _input(model: nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(shape, tuple) or not shape:
        raise ValueError(f"input_shape must be a non-empty tuple, got {shape!r}")
    first = next(model.parameters(), None)
    if first is None:
        return torch.empty(shape)
    return torch.empty(shape, dtype=first.dtype, device=first.device)


# -- DeepSpeed's number formats ------------------------------------------------------------


def number_to_string(num: float, units: str | None = None,
                     precision: int = DEFAULT_PRECISION) -> str:
    """``num`` scaled to T/G/M/K/(none)/m/u (or ``units``), rounded: ``"6.27 K"``."""
    if units is None:
        units = next((u for u, m in _MAGNITUDES.items() if num >= m), "u")
        if num == 0:
            units = ""
    return f"{round(num / _MAGNITUDES.get(units, 1.0), precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None,
                   precision: int = DEFAULT_PRECISION) -> str:
    """``"3.07 KMACs"``."""
    return f"{number_to_string(macs, units=units, precision=precision)}MACs"


def flops_to_string(flops: float, units: str | None = None,
                    precision: int = DEFAULT_PRECISION) -> str:
    """``"71.68 MFLOPS"``."""
    return f"{number_to_string(flops, units=units, precision=precision)}FLOPS"


def params_to_string(params_num: float, units: str | None = None,
                     precision: int = DEFAULT_PRECISION) -> str:
    """``"808"``, ``"5.35 K"``, ``"1.3 B"`` (billions are B)."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params_num, units=units, precision=precision).replace("G", "B").strip()


def duration_to_string(duration: float, units: str | None = None,
                       precision: int = DEFAULT_PRECISION) -> str:
    """``"87.5 us"``."""
    return f"{number_to_string(duration, units=units, precision=precision)}s"
