"""``zero.Init``: build a model already partitioned, so that it never exists whole.

Inside the context, every ``nn.Module`` subclass's ``__init__`` is wrapped: when a
module's outermost ``__init__`` returns, its own parameters (not its children's: they were
partitioned when theirs returned) are broadcast from rank 0 and each rank keeps only its
``1/W`` slice (``p.ds_shard``); ``p.data`` becomes empty and ``p.ds_shape`` keeps the
shape, as in DeepSpeed. ``Module.apply`` is wrapped too, so initialisers such as
``self.apply(_init_weights)`` see whole parameters (gathered one module at a time, then
re-partitioned from rank 0's result). Peak memory while building is one module's
parameters, not the model's.

Tensor constructors are wrapped too, as DeepSpeed's ``partition_parameters`` does:
``torch.tensor``/``empty``/``zeros``/``ones``/``full``/``arange``/``eye``/``randn`` called
inside the context return floating tensors in the context's dtype (the ``dtype`` argument,
else the config's: bf16, fp16, else fp32). Each is wrapped by the module attribute
:func:`zero_wrapper_for_fp_tensor_constructor` as it is when the context is entered, so
a caller that replaces it first (transformers keeps RoPE's ``torch.arange`` in its own dtype
so) is honoured. This module is ``deepspeed.runtime.zero.partition_parameters`` under the
compat alias.

``deepshard.initialize`` then assembles the ZeRO flat groups from these slices
(:func:`full_value` gathers one parameter at a time).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from deepshard.accelerator import get_accelerator
from deepshard.comm import collectives as comm
from deepshard.runtime.zero.marks import register_external_parameter, unregister_external_parameter
from deepshard.runtime.zero.partition import ShardSpec
from deepshard.runtime.zero.status import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator",
           "register_external_parameter", "unregister_external_parameter",
           "zero_wrapper_for_fp_tensor_constructor"]

# the constructors as torch defines them, whatever a context has put in their place
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn
_CONSTRUCTORS = {"tensor": _orig_torch_tensor, "empty": _orig_torch_empty,
                 "zeros": _orig_torch_zeros, "ones": _orig_torch_ones, "full": _orig_torch_full,
                 "arange": _orig_torch_arange, "eye": _orig_torch_eye, "randn": _orig_torch_randn}


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype | None,
                                           target_device: torch.device | None = None
                                           ) -> Callable:
    """DeepSpeed's wrapper of a tensor constructor inside ``zero.Init``: ``device`` defaults
    to ``target_device`` (when given) and a floating result is cast to ``target_fp_dtype``
    (when given)."""

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn




class Init(contextlib.AbstractContextManager):
    """DeepSpeed's ``deepspeed.zero.Init`` (see the module docstring). Its other arguments
    (``remote_device``, ``pin_memory``, ``config_dict_or_path``, ...) are accepted and do
    not change anything here: placement and offload come from the config at initialize."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, **kwargs):
        del mem_efficient_linear, remote_device, pin_memory, mpu, kwargs
        self.enabled = enabled
        self.pg = data_parallel_group
        self.dtype = dtype or _config_dtype(config_dict_or_path if config is None else config)
        self._ids = itertools.count()
        self._constructors: dict[str, Callable] = {}
        self._saved: dict[type, object] = {}
        self._depth: dict[int, int] = {}
        self._apply = None
        if module is not None and enabled:  # an existing model: partition it now
            if not dist.is_initialized():
                from deepshard.comm.distributed import init_distributed

                init_distributed(verbose=False)
            for m in module.modules():
                self._partition(m)

    def __enter__(self):
        if not self.enabled:
            return self
        if not dist.is_initialized():
            from deepshard.comm.distributed import init_distributed

            init_distributed(verbose=False)
        for cls in _subclasses(torch.nn.Module):
            if "__init__" in cls.__dict__:
                self._saved[cls] = cls.__dict__["__init__"]
                cls.__init__ = self._wrap(cls.__dict__["__init__"])  # type: ignore[misc]  # patched on purpose
        self._apply = torch.nn.Module.apply
        torch.nn.Module.apply = self._wrap_apply(self._apply)
        if self.dtype is not None:
            wrapper = globals()["zero_wrapper_for_fp_tensor_constructor"]  # as it is now
            for name, fn in _CONSTRUCTORS.items():
                self._constructors[name] = getattr(torch, name)
                setattr(torch, name, wrapper(fn, target_fp_dtype=self.dtype,
                                             target_device=None))
        return self

    def __exit__(self, *exc) -> None:
        for cls, init in self._saved.items():
            cls.__init__ = init  # type: ignore[misc]  # restored
        self._saved.clear()
        if self._apply is not None:
            torch.nn.Module.apply = self._apply
            self._apply = None
        for name, fn in self._constructors.items():
            setattr(torch, name, fn)
        self._constructors.clear()
        return None

    def _wrap(self, init):
        ctx = self

        @functools.wraps(init)
        def wrapped(module, *args, **kwargs):
            key = id(module)
            ctx._depth[key] = ctx._depth.get(key, 0) + 1
            try:
                init(module, *args, **kwargs)
            finally:
                ctx._depth[key] -= 1
            if ctx._depth[key] == 0:
                del ctx._depth[key]
                ctx._partition(module)

        return wrapped

    def _wrap_apply(self, apply):
        ctx = self

        @functools.wraps(apply)
        def wrapped(module, fn):
            for child in module.children():
                child.apply(fn)
            with _whole(module, ctx.pg):
                fn(module)
            return module

        return wrapped

    @torch.no_grad()
    def _partition(self, module: torch.nn.Module) -> None:
        for p in module.parameters(recurse=False):
            if hasattr(p, "ds_shard"):
                continue
            if self.dtype is not None and p.is_floating_point():
                p.data = p.data.to(self.dtype)
            keep_shard(p, p.data, self.pg, broadcast=True)
            p.ds_id = next(self._ids)


def _config_dtype(config: Any) -> torch.dtype | None:
    """The dtype DeepSpeed's ``zero.Init`` takes from its config: bf16, fp16, else fp32;
    None without a config."""
    if config is None:
        return None
    config = getattr(config, "config", config)  # an HfDeepSpeedConfig
    if not isinstance(config, dict):
        from deepshard.config.dialect import read_config_source

        config, _ = read_config_source(config)
    if (config.get("bf16") or config.get("bfloat16") or {}).get("enabled") is True:
        return torch.bfloat16
    if (config.get("fp16") or {}).get("enabled") is True:
        return torch.float16
    return torch.float32


def _subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        c = todo.pop()
        found.append(c)
        todo.extend(c.__subclasses__())
    return found


def keep_shard(p: torch.nn.Parameter, full: torch.Tensor, pg, broadcast: bool,
               src_rank: int = 0) -> None:
    """Make ``p`` a ``zero.Init`` parameter: keep this rank's slice of ``full`` (first
    broadcast from ``src_rank`` of ``pg`` when ``broadcast``) and empty its ``.data``."""
    world = dist.get_world_size(pg)
    spec = ShardSpec(full.numel(), world)
    flat = full.reshape(-1).contiguous()
    if broadcast and world > 1:
        src = dist.get_global_rank(pg, src_rank) if pg is not None else src_rank
        comm.broadcast(flat, src=src, group=pg)
    lo, hi = spec.bounds(dist.get_rank(pg))
    shard = torch.zeros(spec.shard, dtype=full.dtype, device=full.device)
    real = max(0, min(hi, full.numel()) - lo)
    shard[:real] = flat[lo:lo + real]
    p.ds_shard, p.ds_shape, p.ds_numel, p.ds_pg = shard, full.shape, full.numel(), pg
    p.ds_tensor, p.ds_status = shard, ZeroParamStatus.NOT_AVAILABLE
    p.data = torch.empty(0, dtype=full.dtype, device=full.device)


def init_gather(p: torch.nn.Parameter) -> None:
    """Make a ``zero.Init`` parameter whole in place (``GatheredParameters``)."""
    with torch.no_grad():
        p.data = full_value(p)
    p.ds_status = ZeroParamStatus.AVAILABLE


def init_repartition(p: torch.nn.Parameter, modifier_rank: int | None) -> None:
    """Back to its slice after :func:`init_gather`: from ``modifier_rank``'s values when
    given (broadcast), else the slice it had."""
    with torch.no_grad():
        if modifier_rank is None:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        else:
            keep_shard(p, p.data, p.ds_pg, broadcast=True, src_rank=modifier_rank)


def full_value(p: torch.nn.Parameter) -> torch.Tensor:
    """``p``'s whole value: itself, or gathered from its ``zero.Init`` slices."""
    shard = getattr(p, "ds_shard", None)
    if shard is None:
        return _from_earlier_engine(p)
    pg = p.ds_pg
    shard = shard.to(p.device)
    world = dist.get_world_size(pg)
    full = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    if world > 1:
        comm.all_gather_into_tensor(full, shard, group=pg)
    else:
        full.copy_(shard)
    return full[:p.ds_numel].view(p.ds_shape).to(device=p.device, dtype=p.dtype)


def _from_earlier_engine(p: torch.nn.Parameter) -> torch.Tensor:
    """``p`` itself, or, when a stage 3 engine partitioned it before (``destroy()`` leaves
    it so, as DeepSpeed's does), its whole value gathered from that engine's group."""
    group = getattr(p, "ds_group", None)
    if group is None or not group.partitioned or group.gathered or p.numel():
        return p.detach()
    group.gather()
    try:
        return p.detach().clone()
    finally:
        group.release()


def materialize(module: torch.nn.Module) -> None:
    """Make every ``zero.Init`` parameter of ``module`` whole again (stages 0-2)."""
    with torch.no_grad():
        for p in module.parameters():
            if hasattr(p, "ds_shard"):
                p.data = full_value(p)
                _forget(p)


def adopt(p: torch.nn.Parameter) -> torch.Tensor:
    """The whole value of ``p`` for building a flat group; drops its ``zero.Init`` slice."""
    value = full_value(p)
    _forget(p)
    return value


def _forget(p: torch.nn.Parameter) -> None:
    for attr in ("ds_shard", "ds_pg", "ds_tensor", "ds_status"):
        if hasattr(p, attr):
            delattr(p, attr)


@contextlib.contextmanager
def _whole(module: torch.nn.Module, pg):
    """The module's own ``zero.Init`` parameters whole inside, re-partitioned from rank 0's
    values on exit."""
    own = [p for p in module.parameters(recurse=False) if hasattr(p, "ds_shard")]
    with torch.no_grad():
        for p in own:
            p.data = full_value(p)
    try:
        yield
    finally:
        with torch.no_grad():
            for p in own:
                keep_shard(p, p.data, pg, broadcast=True)


class GatheredParameters(contextlib.AbstractContextManager):
    """DeepSpeed's ``zero.GatheredParameters``: inside the block, the given ZeRO-3
    parameters are whole on every rank; with ``modifier_rank``, that rank's changes are
    broadcast and written back into every rank's shard (and fp32 master) on exit.

    Parameters that are not partitioned (stages 0-2, or small persistent ones) are left as
    they are, as in DeepSpeed; with ``modifier_rank`` their groups are still synchronised.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None,
                 enabled: bool = True):
        del fwd_module  # DeepSpeed's argument for external parameters; not needed here
        if torch.is_tensor(params):
            params = [params]
        self.params = list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self.groups: list[Any] = []  # FlatGroups (flat imports this module)
        self._was_gathered: list[bool] = []
        self._init_params: list[torch.nn.Parameter] = []

    def __enter__(self):
        seen: set[int] = set()
        for p in self.params:
            g = getattr(p, "ds_group", None)
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                self.groups.append(g)
        self._was_gathered = [g.gathered for g in self.groups]
        for g in self.groups:
            g.gather()
            g.holds += 1
        # built under zero.Init and not yet given to initialize: whole for the block
        self._init_params = [p for p in self.params if hasattr(p, "ds_shard")]
        for p in self._init_params:
            init_gather(p)
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.modifier_rank is not None and exc[0] is None:
                with torch.no_grad():
                    for g in self.groups:
                        g.broadcast_full(self.modifier_rank)
                        sync = getattr(g, "on_modified", None)
                        if sync is not None:
                            sync()
                    for p in self._init_params:
                        init_repartition(p, self.modifier_rank)
            else:
                for p in self._init_params:
                    init_repartition(p, None)
        finally:
            for g, was in zip(self.groups, self._was_gathered, strict=True):
                g.holds -= 1
                if not was:
                    g.release(keep_taken=True)
        return None
