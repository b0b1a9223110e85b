"""``zero.Init``: build a model already partitioned, so that it never exists whole.

Inside the context, every ``nn.Module`` subclass's ``__init__`` is wrapped: when a
module's outermost ``__init__`` returns, its own parameters (not its children's: they were
partitioned when theirs returned) are broadcast from rank 0 and each rank keeps only its
``1/W`` slice (``p.ds_shard``); ``p.data`` becomes empty and ``p.ds_shape`` keeps the
shape, as in DeepSpeed. ``Module.apply`` is wrapped too, so initialisers such as
``self.apply(_init_weights)`` see whole parameters (gathered one module at a time, then
re-partitioned from rank 0's result). Peak memory while building is one module's
parameters, not the model's.

``deepshard.initialize`` then assembles the ZeRO flat groups from these slices
(:func:`full_value` gathers one parameter at a time).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from deepshard.comm import collectives as comm
from deepshard.runtime.zero.partition import ShardSpec


class Init(contextlib.AbstractContextManager):
    """DeepSpeed's ``deepspeed.zero.Init`` (see the module docstring). Its other arguments
    (``remote_device``, ``pin_memory``, ``config_dict_or_path``, ...) are accepted and do
    not change anything here: placement and offload come from the config at initialize."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, **kwargs):
        del mem_efficient_linear, remote_device, pin_memory, config_dict_or_path
        del config, mpu, kwargs
        self.enabled = enabled
        self.pg = data_parallel_group
        self.dtype = dtype
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
        return self

    def __exit__(self, *exc) -> None:
        for cls, init in self._saved.items():
            cls.__init__ = init  # type: ignore[misc]  # restored
        self._saved.clear()
        if self._apply is not None:
            torch.nn.Module.apply = self._apply
            self._apply = None
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
    p.data = torch.empty(0, dtype=full.dtype, device=full.device)


def init_gather(p: torch.nn.Parameter) -> None:
    """Make a ``zero.Init`` parameter whole in place (``GatheredParameters``)."""
    with torch.no_grad():
        p.data = full_value(p)


def init_repartition(p: torch.nn.Parameter, modifier_rank: int | None) -> None:
    """Back to its slice after :func:`init_gather`: from ``modifier_rank``'s values when
    given (broadcast), else the slice it had."""
    with torch.no_grad():
        if modifier_rank is None:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
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
    for attr in ("ds_shard", "ds_pg"):
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
