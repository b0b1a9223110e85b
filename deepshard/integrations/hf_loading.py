"""HF models built already partitioned at ZeRO stage 3, and checkpoints read by slices.

While a stage-3 :class:`~deepshard.integrations.hf_config.HfDeepShardConfig` is alive,
``from_pretrained`` and ``from_config`` of every transformers model (``AutoModel*`` and the
model classes alike) return a model in :class:`deepshard.zero.Init`'s format: each
parameter keeps only this rank's ``1/W`` slice in ``p.ds_shard`` and ``p.data`` is empty,
so :func:`deepshard.initialize` at stage 3 takes it as it is.

``from_pretrained`` keeps transformers' own path (config loading, checkpoint resolution,
the dtype choice, building on the meta device, key renames and ``base_model_prefix``
handling, missing-key initialisation, weight tying, the loading report, ``eval()``,
the generation config) and replaces only the step that reads the tensors: each rank reads
with ``safetensors``' ``get_slice`` exactly the elements of its slices, so no rank ever
holds a whole parameter read from the checkpoint. Parameters missing from the checkpoint
(or mismatched, with ``ignore_mismatched_sizes``) are made whole by transformers and
initialised by its initialisers, then cut to rank 0's values; weights that a conversion
(e.g. Mixtral's per-expert tensors fused into one) has to combine are read whole, one
conversion at a time, then cut.

The registration is process-wide, as transformers' ``HfDeepSpeedConfig``'s is, because
``from_pretrained`` is a classmethod called with no handle on the config: it lives on
``transformers.PreTrainedModel`` itself (the patched methods and a weak reference to the
config), and when the config is garbage-collected the original methods are put back.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepshard.errors import UsageError
from deepshard.runtime.zero.init import keep_shard
from deepshard.runtime.zero.partition import ShardSpec

logger = logging.getLogger(__name__)

_REGISTRATION = "_deepshard_zero3"  # the attribute of PreTrainedModel holding it
_LOADING = "_deepshard_partitioned_load"  # marks a model between load and finalize
_BYTES = "_deepshard_bytes_read"
BLOCK = 1 << 22  # elements per read (16 MiB of fp32): bounds the transient copies
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


# the public API -------------------------------------------------------------------------
def register(config: Any, transformers_own: Any = None) -> None:
    """Make ``config`` the live DeepSpeed-style config of this process (the latest wins, as
    in transformers): at stage 3, HF models are then built partitioned until it is
    garbage-collected; any other stage ends a previous registration.

    ``transformers_own``: ``config`` is transformers' own ``HfDeepSpeedConfig`` (the
    ``--deepspeed_compat`` path), registered in this module of transformers
    (``transformers.integrations.deepspeed``). ``from_pretrained`` then reads by slices here
    with transformers' ZeRO-3 switch off for the call (its own ZeRO-3 path would read every
    tensor whole on every rank); ``from_config`` stays transformers' ZeRO-3 path, which
    builds under ``deepspeed.zero.Init`` (deepshard's) as with DeepSpeed."""
    import transformers

    base = transformers.PreTrainedModel
    current = base.__dict__.get(_REGISTRATION)
    if current is not None:
        current.uninstall()
    if config.is_zero3():
        _Registration(base, config, transformers_own).install()


def active_config() -> Any | None:
    """The live stage-3 config that partitions HF models, or ``None``."""
    import transformers

    reg = transformers.PreTrainedModel.__dict__.get(_REGISTRATION)
    return reg.config() if reg is not None else None


def bytes_read(model: torch.nn.Module) -> int:
    """How many bytes of checkpoint tensors this rank read to build ``model`` (0 for a
    model not loaded partitioned)."""
    return int(getattr(model, _BYTES, 0))


# the registration -------------------------------------------------------------------------
class _Registration:
    """The patched methods of ``PreTrainedModel`` while one config is alive."""

    def __init__(self, base: type, config: Any, transformers_own: Any = None):
        self.base = base
        self.config = weakref.ref(config)
        self.transformers_own = transformers_own
        self.saved: dict[str, Any] = {}
        self.finalizer: weakref.finalize | None = None

    def install(self) -> None:
        for name, wrap in _WRAPPERS.items():
            if self.transformers_own is not None and name == "_from_config":
                continue  # transformers' own ZeRO-3 build (see register)
            self.saved[name] = self.base.__dict__[name]
            setattr(self.base, name, wrap(self, self.saved[name]))
        setattr(self.base, _REGISTRATION, self)
        self.finalizer = weakref.finalize(self.config(), self.uninstall)

    def live(self) -> bool:
        return self.config() is not None and self.base.__dict__.get(_REGISTRATION) is self

    def uninstall(self) -> None:
        if self.base.__dict__.get(_REGISTRATION) is not self:
            return
        for name, original in self.saved.items():
            setattr(self.base, name, original)
        delattr(self.base, _REGISTRATION)
        if self.finalizer is not None:
            self.finalizer.detach()


def _wrap_from_pretrained(reg: _Registration, original: Any) -> classmethod:
    func = original.__func__

    @functools.wraps(func)
    def from_pretrained(cls: Any, pretrained_model_name_or_path: Any = None, *args: Any,
                        **kwargs: Any) -> Any:
        if reg.live():
            _ensure_distributed()
            if kwargs.get("state_dict") is None:
                _require_weights(pretrained_model_name_or_path, kwargs.get("subfolder", ""))
        own = reg.transformers_own if reg.live() else None
        if own is None:
            return func(cls, pretrained_model_name_or_path, *args, **kwargs)
        switch = own._hf_deepspeed_config_weak_ref
        own._hf_deepspeed_config_weak_ref = None  # built on meta, read by slices: here
        try:
            return func(cls, pretrained_model_name_or_path, *args, **kwargs)
        finally:
            own._hf_deepspeed_config_weak_ref = switch

    return classmethod(from_pretrained)


def _wrap_from_config(reg: _Registration, original: Any) -> classmethod:
    func = original.__func__

    @functools.wraps(func)
    def _from_config(cls: Any, config: Any, **kwargs: Any) -> Any:
        if not reg.live():
            return func(cls, config, **kwargs)
        return _build_partitioned(func, cls, config, **kwargs)

    return classmethod(_from_config)


def _wrap_load(reg: _Registration, original: Any) -> staticmethod:
    func = original.__func__

    @functools.wraps(func)
    def _load_pretrained_model(model: Any, state_dict: Any, checkpoint_files: Any,
                               load_config: Any, expected_keys: Any = None) -> Any:
        if not reg.live() or load_config.hf_quantizer is not None or not _on_meta(model):
            # (not on the meta device: built by transformers' own ZeRO-3 path, under
            # zero.Init, before the compat path registered the config; its loader goes on)
            return func(model, state_dict, checkpoint_files, load_config, expected_keys)
        return load_partitioned(model, state_dict, checkpoint_files, load_config), None

    return staticmethod(_load_pretrained_model)


def _on_meta(model: Any) -> bool:
    """Whether ``model`` was built on the meta device (transformers' non-ZeRO-3 build)."""
    return all(p.device.type == "meta" for p in model.parameters())


def _wrap_finalize(reg: _Registration, original: Any) -> staticmethod:
    """(``reg`` is not consulted: the mark ``load_partitioned`` leaves on the model decides,
    also when the config died in between.)"""
    func = original.__func__

    @functools.wraps(func)
    def _finalize_model_loading(model: Any, load_config: Any, loading_info: Any) -> Any:
        info = func(model, load_config, loading_info)
        if model.__dict__.pop(_LOADING, False):
            partition_whole(model)
        return info

    return staticmethod(_finalize_model_loading)


_WRAPPERS: dict[str, Callable[[_Registration, Any], Any]] = {
    "from_pretrained": _wrap_from_pretrained,
    "_from_config": _wrap_from_config,
    "_load_pretrained_model": _wrap_load,
    "_finalize_model_loading": _wrap_finalize,
}


def _ensure_distributed() -> None:
    if not dist.is_initialized():
        from deepshard.comm.distributed import init_distributed

        init_distributed(verbose=False)


def _require_weights(path: Any, subfolder: str) -> None:
    """A local directory must hold weights (transformers' own error for a remote name)."""
    if path is None or not os.path.isdir(os.path.join(os.fspath(path), subfolder)):
        return
    folder = Path(path, subfolder)
    if not any(f.name.endswith(WEIGHT_SUFFIXES) for f in folder.iterdir()):
        raise UsageError("no model weights here (no *.safetensors, no index)",
                         where=str(folder),
                         hint="pass the directory model.save_pretrained(...) wrote, the one "
                              "with model.safetensors or model.safetensors.index.json")


# from_config ------------------------------------------------------------------------------
def _build_partitioned(from_config: Callable, cls: type, config: Any, **kwargs: Any) -> Any:
    """``cls._from_config`` under ``zero.Init`` with transformers' initialisers run on each
    module's gathered parameters (transformers' ``initialize_weights_zero3``)."""
    from transformers import initialization

    from deepshard.runtime.zero.init import Init

    _ensure_distributed()
    with initialization.no_init_weights(), Init():
        model = from_config(cls, config, **kwargs)
    initialize_gathered(model)
    model.tie_weights()
    return model


def initialize_gathered(model: Any) -> None:
    """Run transformers' weight initialisers on a partitioned ``model``, one module at a
    time with its parameters (and its direct children's) gathered, on rank 0, whose
    values every rank then keeps its slice of."""
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    from deepshard.runtime.zero.init import GatheredParameters

    custom = model.is_remote_code()
    rank = dist.get_rank()

    def visit(module: torch.nn.Module, fn: Callable) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else fn)
        params = list(module.parameters(recurse=False))
        for child in module.children():
            if not isinstance(child, PreTrainedModel):
                params.extend(child.parameters(recurse=False))
        with GatheredParameters(params, modifier_rank=0):
            if rank == 0 or not params:
                fn(module, custom)

    with torch.no_grad(), guard_torch_init_functions():
        visit(model, model._initialize_weights)


# from_pretrained: reading the checkpoint -------------------------------------------------
class Checkpoint:
    """The tensors of a checkpoint by name, read by flat element ranges.

    Args:
        files: safetensors files (one, or the shards an index names).
        state_dict: tensors already in memory (``from_pretrained(state_dict=...)``), used
            instead of files.
    """

    def __init__(self, files: Iterable[str] = (), state_dict: dict | None = None):
        self.handles: dict[str, Any] = {}
        self.pending: dict[str, set[str]] = {}
        self.where: dict[str, str] = {}
        self.memory = dict(state_dict or {})
        self.bytes_read = 0
        for file in files:
            handle = _open(file)
            self.handles[file] = handle
            self.pending[file] = set(handle.keys())
            for key in self.pending[file]:
                self.where[key] = file
        for key in self.memory:
            self.where[key] = "state_dict"

    def keys(self) -> list[str]:
        return list(self.where)

    def shape(self, key: str) -> torch.Size:
        if key in self.memory:
            return self.memory[key].shape
        return torch.Size(self._slice(key).get_shape())

    def _slice(self, key: str) -> Any:
        return self.handles[self.where[key]].get_slice(key)

    def read_into(self, key: str, lo: int, out: torch.Tensor) -> None:
        """Elements ``[lo, lo + out.numel())`` of the flattened tensor ``key`` into ``out``
        (1-D; cast to its dtype): only those are read, a bounded block at a time."""
        if key in self.memory:
            out.copy_(self.memory[key].reshape(-1)[lo:lo + out.numel()])
            self.bytes_read += out.numel() * self.memory[key].element_size()
        else:
            sl = self._slice(key)
            self.bytes_read += read_range(sl, tuple(sl.get_shape()), lo, out)

    def read(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor ``key`` in its own dtype."""
        dtype = self.memory[key].dtype if key in self.memory else _DTYPES.get(
            self._slice(key).get_dtype())
        if dtype is None:  # a dtype torch names differently (fp8...): read as it comes
            whole = self._slice(key)[...].reshape(-1)
            self.bytes_read += whole.numel() * whole.element_size()
            return whole[lo:hi].clone()
        out = torch.empty(max(0, hi - lo), dtype=dtype)
        self.read_into(key, lo, out)
        return out

    def done(self, key: str) -> None:
        """``key`` will not be read again: a file is closed once all its tensors are, so
        that the pages of its mapping that were read stop counting in this rank's RSS."""
        file = self.where[key]
        left = self.pending.get(file)
        if left is not None:
            left.discard(key)
            if not left:
                del self.pending[file], self.handles[file]

    def read_whole(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (for buffers and conversions only)."""
        shape = self.shape(key)
        return self.read(key, 0, math.prod(shape)).reshape(shape)


def _open(file: str) -> Any:
    """``safe_open`` reading with ``pread`` where safetensors has it (0.8): a block read
    is then its own bytes, not pages of a mapping of the file that count in the rank's
    RSS until the file is closed."""
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt", backend="pread")
    except TypeError:
        return safe_open(file, framework="pt")


def read_range(sl: Any, shape: tuple[int, ...], lo: int, out: torch.Tensor,
               index: tuple = ()) -> int:
    """Copy elements ``[lo, lo + out.numel())`` of the row-major tensor ``sl[index]`` of
    ``shape``, flattened, into ``out``; returns the bytes read. Per dimension at most two
    partial rows besides whole rows, these in blocks of about ``BLOCK`` elements (what
    safetensors holds at once while copying)."""
    hi = lo + out.numel()
    if hi <= lo:
        return 0
    if not shape:
        return _read_block(sl, ..., out)
    if len(shape) == 1:
        return sum(_read_block(sl, (*index, slice(a, min(hi, a + BLOCK))),
                               out[a - lo:min(hi, a + BLOCK) - lo])
                   for a in range(lo, hi, BLOCK))
    row = math.prod(shape[1:])
    first, last = lo // row, (hi - 1) // row
    if first == last:
        return read_range(sl, shape[1:], lo - first * row, out, (*index, first))
    done, pos, start, stop = 0, 0, first, last + 1
    if lo % row:
        pos = row - lo % row
        done += read_range(sl, shape[1:], lo % row, out[:pos], (*index, first))
        start += 1
    tail = hi - last * row
    if tail < row:
        stop -= 1
    step = BLOCK // row
    for r in range(start, stop, max(1, step)):
        if step == 0:  # a row is bigger than a block: recurse into it
            done += read_range(sl, shape[1:], 0, out[pos:pos + row], (*index, r))
            pos += row
            continue
        end = min(stop, r + step)
        done += _read_block(sl, (*index, slice(r, end)), out[pos:pos + (end - r) * row])
        pos += (end - r) * row
    if tail < row:
        done += read_range(sl, shape[1:], 0, out[pos:], (*index, last))
    return done


def _read_block(sl: Any, key: Any, out: torch.Tensor) -> int:
    block = sl[key]
    out.copy_(block.reshape(-1))
    return int(block.numel() * block.element_size())


def _checkpoint_for(state_dict: dict | None, files: list[str] | None) -> Checkpoint:
    if state_dict is not None:
        return Checkpoint(state_dict=state_dict)
    files = list(files or [])
    if not files:
        raise UsageError("no checkpoint files to load", hint="pass a directory with "
                                                             "model.safetensors")
    pickled = [f for f in files if not f.endswith(".safetensors")]
    if pickled:
        raise UsageError("ZeRO-3 loading reads tensors by slices, which needs safetensors",
                         where=pickled[0], hint="re-save the checkpoint with "
                                                "save_pretrained(..., safe_serialization=True)")
    return Checkpoint(files)


# from_pretrained: loading into partitioned parameters -------------------------------------
def load_partitioned(model: Any, state_dict: dict | None, checkpoint_files: list[str] | None,
                     load_config: Any) -> Any:
    """transformers' ``_load_pretrained_model`` for a meta-device ``model`` at stage 3: each
    parameter becomes a ``zero.Init`` parameter holding this rank's slice read from the
    checkpoint; buffers are read whole. Returns transformers' ``LoadStateDictInfo``."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )
    from transformers.utils.loading_report import LoadStateDictInfo

    if load_config.device_map is not None:
        raise UsageError("device_map cannot be combined with ZeRO-3 partitioned loading",
                         where="from_pretrained(device_map=...)",
                         hint="drop device_map: the stage-3 engine places the shards")
    ckpt = _checkpoint_for(state_dict, checkpoint_files)
    meta = model.state_dict()
    info = LoadStateDictInfo(missing_keys=set(meta), unexpected_keys=set(), mismatched_keys=set(),
                             conversion_errors={}, error_msgs=[], skipped_pp_keys=set())
    mapping = load_config.weight_mapping or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    dtype_of = _dtype_rule(load_config, meta)
    converted: dict[str, Any] = {}
    prefix = model.base_model_prefix
    for key in sorted(ckpt.keys(), key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if target not in meta and key in meta:
            target, pattern = rename_source_key(key, [], [], prefix, meta)
        if target not in meta:
            _unexpected(info, target, by_pattern.get(pattern) if pattern else None)
        elif pattern is not None:
            job = converted.setdefault(target, copy.deepcopy(by_pattern[pattern]))
            job.add_tensor(target, key, pattern, functools.partial(
                _whole_as, ckpt, key, dtype_of(target)))
            continue  # read when its conversion runs
        else:
            _load_tensor(model, target, key, ckpt, dtype_of(target), info, load_config)
        ckpt.done(key)
    if converted:
        logger.warning("ZeRO-3 loading: %d parameters (e.g. %s) come from a conversion of "
                       "several checkpoint tensors, which are read whole on every rank, one "
                       "conversion at a time, then cut", len(converted), next(iter(converted)))
    for target, job in converted.items():
        _load_converted(model, target, job, info, load_config)
    _untie_differing(model, info)
    model._weight_conversions = [m for m in mapping if m.was_used()]
    model.__dict__[_LOADING] = True
    setattr(model, _BYTES, ckpt.bytes_read)
    return info


def _untie_differing(model: Any, info: Any) -> None:
    """transformers does not tie two weights the checkpoint holds with different values;
    its check compares ``p.data``, empty here, so compare the slices instead."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for target, source in list(tied.items()):
        if target in info.missing_keys or source in info.missing_keys:
            continue
        a, b = model.get_parameter(source), model.get_parameter(target)
        if not (hasattr(a, "ds_shard") and hasattr(b, "ds_shard")):
            continue
        differ = torch.tensor(int(a.ds_shape != b.ds_shape or not torch.equal(a.ds_shard,
                                                                              b.ds_shard)))
        dist.all_reduce(differ)
        if differ.item():
            logger.warning("%s and %s are tied in the config but differ in the checkpoint: "
                           "not tied (set tie_word_embeddings=False to silence this)",
                           source, target)
            tied.pop(target)


def _dtype_rule(load_config: Any, meta: dict) -> Callable[[str], torch.dtype | None]:
    """transformers' dtype for a loaded tensor: a ``keep_in_fp32`` rule, else the dtype of
    the parameter the model was built with."""
    plan = load_config.dtype_plan or {}
    search = None
    if plan:
        from transformers.core_model_loading import build_glob_alternation

        alternation, group_of, _ = build_glob_alternation(list(plan))
        search = alternation.search

    def dtype_of(target: str) -> torch.dtype | None:
        found = search(target) if search is not None else None
        if found is not None and found.lastgroup is not None:
            return plan[group_of[found.lastgroup]]
        empty = meta.get(target)
        return empty.dtype if empty is not None else load_config.dtype

    return dtype_of


def _unexpected(info: Any, target: str, converter: Any) -> None:
    if converter is None:
        info.unexpected_keys.add(target)
        return
    for name in converter.target_patterns:
        info.unexpected_keys.add(target.replace(converter.target_patterns[0], name))


def _whole_as(ckpt: Checkpoint, key: str, dtype: torch.dtype | None) -> torch.Tensor:
    value = ckpt.read_whole(key)
    return value.to(dtype) if dtype is not None and value.is_floating_point() else value


def _load_tensor(model: Any, target: str, key: str, ckpt: Checkpoint, dtype: torch.dtype | None,
                 info: Any, load_config: Any) -> None:
    """One checkpoint tensor into ``target``: its slice into a parameter, whole into a
    buffer, or a mismatch (an error unless ``ignore_mismatched_sizes``)."""
    from transformers.core_model_loading import set_param_for_module

    module_name, _, name = target.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if name not in module._parameters:
        set_param_for_module(model, target, _whole_as(ckpt, key, dtype), info, None)
        return
    info.missing_keys.discard(target)
    ref, shape = module._parameters[name], ckpt.shape(key)
    if shape != ref.shape:
        _mismatch(info, target, key, shape, ref.shape, ckpt, load_config)
        return
    spec = ShardSpec(math.prod(shape), dist.get_world_size())
    lo, hi = spec.bounds(dist.get_rank())
    shard = torch.zeros(spec.shard, dtype=dtype or ref.dtype)
    ckpt.read_into(key, lo, shard[:max(0, min(hi, spec.numel) - lo)])
    module._parameters[name] = shard_parameter(shard, spec, shape)


def _mismatch(info: Any, target: str, key: str, got: torch.Size, want: torch.Size,
              ckpt: Checkpoint, load_config: Any) -> None:
    if not load_config.ignore_mismatched_sizes:
        raise UsageError(f"tensor {key!r} has shape {tuple(got)} in the checkpoint but the "
                         f"model's {target!r} is {tuple(want)}", where=ckpt.where[key],
                         hint="load it with the config it was saved with, or pass "
                              "ignore_mismatched_sizes=True to initialise it anew")
    info.mismatched_keys.add((target, got, want))


def shard_parameter(shard: torch.Tensor, spec: ShardSpec,
                    shape: torch.Size) -> torch.nn.Parameter:
    """A ``zero.Init`` parameter of ``shape`` whose slice (split per ``spec``, zero-padded)
    is ``shard``."""
    dtype = shard.dtype
    p = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=dtype.is_floating_point)
    p.ds_shard, p.ds_shape, p.ds_numel, p.ds_pg = shard, torch.Size(shape), spec.numel, None
    p._is_hf_initialized = True
    return p


def _load_converted(model: Any, first: str, job: Any, info: Any, load_config: Any) -> None:
    """A conversion's targets (read whole: the conversion needs its sources whole), each
    cut to this rank's slice."""
    from transformers.core_model_loading import SkipParameters

    try:
        realized = job.convert(first, model=model, config=model.config, hf_quantizer=None,
                               loading_info=info)
    except SkipParameters:
        return
    for target, value in realized.items():
        value = value[0] if isinstance(value, list) else value
        module_name, _, name = target.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        info.missing_keys.discard(target)
        ref = getattr(module, name)
        if name not in module._parameters:
            from transformers.core_model_loading import set_param_for_module

            set_param_for_module(model, target, value, info, None)
        elif value.shape != ref.shape:
            if not load_config.ignore_mismatched_sizes:
                raise UsageError(f"converted tensor {target!r} has shape {tuple(value.shape)} "
                                 f"but the model's is {tuple(ref.shape)}",
                                 where=str(load_config.pretrained_model_name_or_path),
                                 hint="load it with the config it was saved with")
            info.mismatched_keys.add((target, value.shape, ref.shape))
        else:
            spec = ShardSpec(value.numel(), dist.get_world_size())
            lo, hi = spec.bounds(dist.get_rank())
            shard = torch.zeros(spec.shard, dtype=ref.dtype)
            real = max(0, min(hi, spec.numel) - lo)
            shard[:real] = value.reshape(-1)[lo:lo + real]
            module._parameters[name] = shard_parameter(shard, spec, value.shape)


@torch.no_grad()
def partition_whole(model: torch.nn.Module) -> None:
    """Cut every whole parameter of ``model`` (those transformers initialised because the
    checkpoint lacked them) to this rank's slice of rank 0's values; parameters still on
    the meta device are left alone."""
    for p in model.parameters():
        if not (hasattr(p, "ds_shard") or p.is_meta):
            keep_shard(p, p.data, None, broadcast=True)
