"""Random layerwise token dropping (random-LTD): the layer wrapper and the model conversion.

A wrapped layer, in training, runs on a random subset of each sequence's tokens (as many as
the schedule of :mod:`deepshard.data_efficiency.ltd_schedule` keeps) and passes the other
tokens through unchanged. DeepSpeed does the gather and scatter with CUDA kernels; here they
are ``torch.gather`` and ``Tensor.scatter``, so it runs on any device and autograd derives the
backward. What the layer receives along the sequence is gathered with the tokens, so it sees
a consistent shorter sequence: the attention mask (rows and columns of the kept positions),
rotary ``position_embeddings`` and ``position_ids`` (each kept token keeps its original
position). Kept positions stay in sequence order, so a causal mask stays causal.

Two ways to make a layer drop tokens, with the same forward (:class:`TokenDrop`):

- in place (:func:`convert_to_random_ltd`, :func:`convert_layers_by_id`, and what
  ``initialize`` does for the config's ``random_ltd_layer_id``): the layer's ``forward`` is
  replaced on the instance, as Accelerate's hooks do; module names, state-dict keys and
  hooks stay the model's own, so checkpoints, ``save_pretrained`` and ZeRO-3's parameter
  hooks see the plain model (DeepSpeed's module states on disk have these keys too: it
  strips its wrapper's component when saving);
- DeepSpeed's wrapper module :class:`RandomLayerTokenDrop` (attribute ``random_ltd_layer``,
  so in-memory keys are ``...layers.3.random_ltd_layer.mlp.weight``), for code that builds
  it itself; :func:`remove_random_ltd_state_dict` gives back the unwrapped keys.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from deepshard.data_efficiency.ltd_schedule import PATH, RandomLtdSchedule, RandomLtdSpec
from deepshard.errors import UsageError

WRAPPED = "random_ltd_layer"
"""The wrapper's attribute holding the layer: the extra component of state-dict keys."""


def draw_kept_indices(batch: int, seq: int, kept: int, device: Any = None,
                      seed: int | None = None) -> torch.Tensor:
    """``[batch, kept]`` int64: per sample, ``kept`` distinct positions of ``range(seq)``,
    uniformly at random, in increasing order: drawn from a generator seeded with ``seed``
    (``None``: torch's global generator of ``device``)."""
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device or "cpu").manual_seed(seed)
    order = torch.rand(batch, seq, device=device, generator=generator).argsort(dim=1)
    return order[:, :kept].sort(dim=1).values


class TokenDrop:
    """The dropping forward of one layer: ``plain`` (the layer's own call) on the kept
    tokens, once bound to a schedule (see :class:`RandomLayerTokenDrop` for what is
    gathered and returned). ``owner`` is the module whose ``training`` flag decides."""

    def __init__(self, owner: nn.Module, plain: Callable[..., Any], layer: nn.Module):
        self.owner, self.plain = owner, plain
        self.layer_name = type(layer).__name__
        self.arg_names = _positional_names(plain)
        self.scheduler: RandomLtdSchedule | None = None
        self.layer_id: int | None = None
        self.mask_name: str | None = None
        self.batch_first = True
        self.kept_indices: torch.Tensor | None = None

    def bind(self, spec: RandomLtdSpec, scheduler: RandomLtdSchedule, layer_id: int) -> None:
        """Drop tokens by ``scheduler``; ``layer_id``: the position among dropping layers."""
        self.scheduler, self.layer_id = scheduler, layer_id
        self.mask_name = spec.model_mask_name
        self.batch_first = spec.hidden_state_order == "batch_seq_dim"

    def unbind(self) -> None:
        """Back to the plain call."""
        self.scheduler, self.layer_id = None, None

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        scheduler = self.scheduler
        seq_dim, batch_dim = (1, 0) if self.batch_first else (0, 1)
        if not self.owner.training or scheduler is None:
            return self.plain(hidden_states, *args, **kwargs)
        seq, batch = hidden_states.shape[seq_dim], hidden_states.shape[batch_dim]
        kept = scheduler.get_current_seq()
        if kept >= seq:
            return self.plain(hidden_states, *args, **kwargs)
        index = draw_kept_indices(batch, seq, kept, hidden_states.device,
                                  scheduler.draw_key(self.layer_id or 0))
        self.kept_indices = index
        gather = _ArgGather(index, seq, self.mask_name, self.layer_name)
        args, kwargs = self._rewrite(args, kwargs, gather)
        part = _gather_tokens(hidden_states, index, seq_dim)
        outputs = self.plain(part, *args, **kwargs)
        return _replace_hidden(outputs, lambda out: _scatter_tokens(
            hidden_states, out, index, seq_dim), self.layer_name)

    def _rewrite(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 gather: _ArgGather) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # arguments keep their positions: HF's checkpointing layers rely on which are positional
        names = self.arg_names
        new_args = tuple(gather(names[i], a) if i < len(names) else a
                         for i, a in enumerate(args))
        return new_args, {k: gather(k, v) for k, v in kwargs.items()}


_PATCH = "_random_ltd_drop"
"""The instance attribute of a layer patched in place: its :class:`TokenDrop`."""


def patch_layer(layer: nn.Module) -> TokenDrop:
    """Make ``layer`` drop tokens in place (its ``forward`` replaced on the instance; a
    patched layer is left as it is). Returns its :class:`TokenDrop`, unbound."""
    drop = token_drop_of(layer)
    if drop is None:
        drop = TokenDrop(layer, layer.forward, layer)
        layer.__dict__[_PATCH] = drop
        layer.forward = drop
    return drop


def token_drop_of(module: nn.Module) -> TokenDrop | None:
    """The :class:`TokenDrop` of a patched layer or of a :class:`RandomLayerTokenDrop`."""
    if isinstance(module, RandomLayerTokenDrop):
        return module.drop
    drop = module.__dict__.get(_PATCH)
    return drop if isinstance(drop, TokenDrop) else None


class RandomLayerTokenDrop(nn.Module):
    """Runs ``layer`` on the kept tokens only, in training, once bound to a schedule.

    Unbound (:meth:`init_config` not called), in eval mode, or when the schedule keeps at
    least the whole sequence, ``forward`` is the plain layer call. Otherwise each forward
    draws fresh kept positions per sample (:func:`draw_kept_indices`; the last ones are in
    :attr:`kept_indices`), gathers them from the hidden states (the first argument) and from
    what the layer gets along the sequence (see the module docstring), calls the layer, and
    scatters its hidden-state output into a copy of the input. The output keeps the layer's
    own structure: a tensor, a tuple or list with the hidden states first, or a mapping
    (HF ``ModelOutput``) whose first entry they are; other entries (attention weights) stay
    of the kept length, and so are a dropping layer's entries of HF's
    ``output_hidden_states`` (hooks on the wrapped layer record them). Attributes the
    wrapper lacks are read from the layer (``attention_type``, ``layer_idx``).

    Each dropping layer draws its own positions when it runs (DeepSpeed draws all layers'
    at the first dropping layer): the same distribution, and nothing is shared between
    layers, so a pipeline stage holding some of the layers, or a recomputation under
    activation checkpointing with the RNG state restored, sees the positions it should.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.random_ltd_layer = layer
        self.drop = TokenDrop(self, layer, layer)
        self.drop.arg_names = _positional_names(layer.forward)

    @property
    def random_ltd_scheduler(self) -> RandomLtdSchedule | None:
        """The schedule it is bound to (DeepSpeed's attribute)."""
        return self.drop.scheduler

    @property
    def random_ltd_layer_id(self) -> int | None:
        """Its position among the dropping layers (DeepSpeed's attribute)."""
        return self.drop.layer_id

    @property
    def kept_indices(self) -> torch.Tensor | None:
        """The positions the last dropping forward kept, ``[batch, kept]``."""
        return self.drop.kept_indices

    def init_config(self, spec: RandomLtdSpec, scheduler: RandomLtdSchedule,
                    random_ltd_layer_id: int) -> None:
        """Bind to ``scheduler``; ``random_ltd_layer_id`` is this layer's position among the
        dropping layers (0 for the first), as DeepSpeed's ``init_config``."""
        self.drop.bind(spec, scheduler, random_ltd_layer_id)

    def unbind(self) -> None:
        """Back to the plain layer call."""
        self.drop.unbind()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # HF model loops read layer attributes (attention_type, layer_idx) off the list
            layer = self.__dict__.get("_modules", {}).get(WRAPPED)
            if layer is None or name == WRAPPED:
                raise
            return getattr(layer, name)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The layer on the kept tokens (see the class docstring)."""
        return self.drop(hidden_states, *args, **kwargs)


class _ArgGather:
    """Gathers one layer argument, chosen by name, along the sequence with the kept tokens."""

    def __init__(self, index: torch.Tensor, seq: int, mask_name: str | None, layer: str):
        self.index, self.seq, self.mask_name, self.layer = index, seq, mask_name, layer

    def __call__(self, name: str, value: Any) -> Any:
        if value is None:
            return value
        if name == self.mask_name:
            return self._mask(value)
        if name == "position_embeddings" and isinstance(value, (tuple, list)):
            return type(value)(self._batch_first(name, t) for t in value)
        if name == "position_ids" and isinstance(value, torch.Tensor):
            return self._batch_first(name, value)
        if (name == "attention_mask" and isinstance(value, torch.Tensor)
                and value.shape[-1] == self.seq):
            raise UsageError(f"{self.layer} gets an attention_mask, which random-LTD must "
                             "gather with the kept tokens", where=f"{PATH}.model_mask_name",
                             hint='set model_mask_name to "attention_mask"')
        return value

    def _batch_first(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``[batch or 1, seq, ...]`` (HF's layout of positions) gathered along dim 1."""
        b, k = self.index.shape
        if t.dim() < 2 or t.shape[1] != self.seq or t.shape[0] not in (1, b):
            raise UsageError(f"random-LTD cannot gather {name} of shape {tuple(t.shape)} for "
                             f"{self.layer}: expected [batch or 1, {self.seq}, ...]",
                             where=f"{PATH}.random_ltd_layer_id")
        t = t.expand(b, *t.shape[1:])
        idx = self.index.view(b, k, *([1] * (t.dim() - 2))).expand(b, k, *t.shape[2:])
        return t.gather(1, idx)

    def _mask(self, mask: Any) -> torch.Tensor:
        """A ``[batch or 1, seq]`` padding mask or a ``[batch or 1, ..., q, k]`` attention
        mask: the kept columns, and the kept rows where ``q`` is the sequence."""
        if not isinstance(mask, torch.Tensor) or mask.dim() < 2:
            raise UsageError(f"random-LTD can gather a 2-D to 4-D tensor mask, {self.layer} gets "
                             f"{type(mask).__name__}", where=f"{PATH}.model_mask_name",
                             hint="use an attention implementation with tensor masks (sdpa, eager)")
        b, k = self.index.shape
        if mask.shape[0] not in (1, b) or mask.shape[-1] != self.seq:
            raise UsageError(f"random-LTD cannot gather a mask of shape {tuple(mask.shape)} for "
                             f"{self.layer}: expected [batch or 1, ..., {self.seq}]",
                             where=f"{PATH}.model_mask_name")
        mask = mask.expand(b, *mask.shape[1:])
        if mask.dim() == 2:
            return mask.gather(1, self.index)
        mid = [1] * (mask.dim() - 3)  # the dims between batch and (q, k): heads
        if mask.shape[-2] == self.seq:
            rows = self.index.view(b, *mid, k, 1).expand(*mask.shape[:-2], k, mask.shape[-1])
            mask = mask.gather(-2, rows)
        cols = self.index.view(b, *mid, 1, k).expand(*mask.shape[:-1], k)
        return mask.gather(-1, cols)


def _gather_tokens(x: torch.Tensor, index: torch.Tensor, seq_dim: int) -> torch.Tensor:
    return x.gather(seq_dim, _token_index(x, index, seq_dim))


def _scatter_tokens(full: torch.Tensor, part: torch.Tensor, index: torch.Tensor,
                    seq_dim: int) -> torch.Tensor:
    # out of place: the dropped tokens' outputs are the inputs, and their gradient passes
    return full.to(part.dtype).scatter(seq_dim, _token_index(part, index, seq_dim), part)


def _token_index(x: torch.Tensor, index: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """``index`` ([batch, kept]) laid out and expanded for gather/scatter on ``x``."""
    idx = index if seq_dim == 1 else index.t()
    idx = idx.reshape(*idx.shape, *([1] * (x.dim() - 2)))
    shape = list(x.shape)
    shape[seq_dim] = index.shape[1]
    return idx.expand(shape)


def _replace_hidden(outputs: Any, scatter: Callable[[torch.Tensor], torch.Tensor],
                    layer: str) -> Any:
    if isinstance(outputs, torch.Tensor):
        return scatter(outputs)
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        items = [scatter(outputs[0]), *outputs[1:]]
        if hasattr(outputs, "_fields"):  # a namedtuple
            return type(outputs)(*items)
        return type(outputs)(items)
    if isinstance(outputs, Mapping) and outputs:
        first = next(iter(outputs))
        return type(outputs)(**{**outputs, first: scatter(outputs[first])})
    raise UsageError(f"random-LTD needs {layer} to return its hidden states as a tensor, the "
                     f"first item of a tuple or the first entry of a mapping, got "
                     f"{type(outputs).__name__}", where=f"{PATH}.random_ltd_layer_id")


def _positional_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    """The names of a bound forward's positional parameters after the hidden states, up to
    ``*args`` (later positional arguments are passed as they are)."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return ()
    names: list[str] = []
    for p in params[1:]:
        if p.kind is p.VAR_POSITIONAL or p.kind is p.KEYWORD_ONLY or p.kind is p.VAR_KEYWORD:
            break
        names.append(p.name)
    return tuple(names)


def convert_to_random_ltd(model: Any, convert_type: type | tuple[type, ...]) -> Any:
    """Make every submodule of ``model`` that is a ``convert_type`` drop tokens, as
    DeepSpeed's function of that name, but in place (:func:`patch_layer`: names and
    state-dict keys stay the model's).

    ``model`` is an engine (its ``.module`` is converted) or a module. When ``model`` has
    ``random_ltd_initialize`` (the engine), it is then called to bind the layers to the
    schedule. Converted layers and layers inside a converted one are left as they are.
    Returns ``model``.
    """
    root = model.module if hasattr(model, "module") else model
    converted: list[str] = []
    for name, sub in list(root.named_modules()):
        if not isinstance(sub, convert_type) or _inside(name, converted):
            continue
        if not name:
            raise UsageError(f"the model itself is a {type(sub).__name__}",
                             where="convert_to_random_ltd",
                             hint="pass the class of its transformer layers as convert_type")
        parent = root.get_submodule(name.rpartition(".")[0])
        if not isinstance(parent, RandomLayerTokenDrop):
            patch_layer(sub)
        converted.append(name)
    if hasattr(model, "random_ltd_initialize"):
        model.random_ltd_initialize()
    return model


def convert_layers_by_id(model: Any, random_ltd_layer_id: Iterable[int],
                         layers: nn.ModuleList | None = None) -> Any:
    """Make the layers at ``random_ltd_layer_id`` of the model's layer list drop tokens, in
    place (:func:`patch_layer`), without naming their class. Returns ``model`` (calling its
    ``random_ltd_initialize`` if it has one).

    ``layers`` defaults to :func:`find_layer_list` of ``model`` (of ``model.module`` for an
    engine). An index past the list's end is a :class:`UsageError`.
    """
    root = model.module if hasattr(model, "module") else model
    if layers is None:
        layers = find_layer_list(root)
    for index in sorted(set(random_ltd_layer_id)):
        if not 0 <= index < len(layers):
            raise UsageError(f"layer {index} does not exist: {type(root).__name__} has "
                             f"{len(layers)} layers", where=f"{PATH}.random_ltd_layer_id")
        if not isinstance(layers[index], RandomLayerTokenDrop):
            patch_layer(layers[index])
    if hasattr(model, "random_ltd_initialize"):
        model.random_ltd_initialize()
    return model


def find_layer_list(model: nn.Module) -> nn.ModuleList:
    """The model's transformer layers: the longest ``nn.ModuleList`` whose entries are all of
    one class (a wrapped layer counts as its layer's class), not nested in another such list
    (an MoE layer's experts). HF Llama/Qwen2: ``model.layers``; GPT-2: ``transformer.h``;
    deepshard's example GPT: ``blocks``. No such list, or two of the same length (an
    encoder-decoder), is a :class:`UsageError` naming the model's class."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, sub in model.named_modules():
        if (isinstance(sub, nn.ModuleList) and len(sub) > 0 and _homogeneous(sub)
                and not _inside(name, [n for n, _ in found])):
            found.append((name, sub))
    hint = "pass the list as layers= (e.g. model.model.layers)"
    if not found:
        raise UsageError(f"{type(model).__name__} has no nn.ModuleList of identical layers",
                         where="convert_layers_by_id", hint=hint)
    longest = max(len(sub) for _, sub in found)
    best = [(n, sub) for n, sub in found if len(sub) == longest]
    if len(best) > 1:
        raise UsageError(f"{type(model).__name__} has several layer lists of {longest} layers: "
                         f"{', '.join(n for n, _ in best)}", where="convert_layers_by_id",
                         hint=hint)
    return best[0][1]


def bind_random_ltd(module: nn.Module, scheduler: RandomLtdSchedule,
                    spec: RandomLtdSpec | None = None) -> list[TokenDrop]:
    """Bind the converted layers (patched or wrapped) at ``spec.random_ltd_layer_id`` to
    ``scheduler``, as DeepSpeed's ``engine.random_ltd_initialize``; returns their
    :class:`TokenDrop` in model order.

    A converted layer's id is the last all-digit component of its module name (its index in
    its layer list; DeepSpeed tests ``str(id) in name``). ``spec`` defaults to
    ``scheduler.spec``. Converted layers not chosen are unbound (plain calls). An id with no
    converted layer is a :class:`UsageError`.
    """
    spec = spec if spec is not None else scheduler.spec
    wanted = set(spec.random_ltd_layer_id)
    bound: list[TokenDrop] = []
    found: set[int] = set()
    for name, sub in module.named_modules():
        drop = token_drop_of(sub)
        if drop is None:
            continue
        index = _layer_index(name)
        if index in wanted and index not in found:
            found.add(index)
            drop.bind(spec, scheduler, len(bound))
            bound.append(drop)
        else:
            drop.unbind()
    if len(bound) != spec.random_ltd_layer_num:
        missing = sorted(wanted - found)
        raise UsageError(f"random_ltd_layer_num is {spec.random_ltd_layer_num} but "
                         f"{len(bound)} converted layers match random_ltd_layer_id (no converted "
                         f"layer {missing})", where=f"{PATH}.random_ltd_layer_id",
                         hint="convert the model first (convert_to_random_ltd)")
    return bound


def remove_random_ltd_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """``state_dict`` with the wrappers' ``random_ltd_layer`` key component removed: the
    keys of the unwrapped model (DeepSpeed saves module states this way)."""
    return OrderedDict(
        (".".join(part for part in key.split(".") if part != WRAPPED), value)
        for key, value in state_dict.items())


def save_without_random_ltd(model: Any) -> OrderedDict[str, Any]:
    """The state dict of ``model`` (or of an engine's ``.module``) with unwrapped keys."""
    root = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(root.state_dict())


def _homogeneous(layers: nn.ModuleList) -> bool:
    kinds = {type(m.random_ltd_layer) if isinstance(m, RandomLayerTokenDrop) else type(m)
             for m in layers}
    return len(kinds) == 1


def _inside(name: str, parents: Iterable[str]) -> bool:
    return any(p == "" or name.startswith(p + ".") for p in parents)


def _layer_index(name: str) -> int | None:
    digits = [part for part in name.split(".") if part.isdigit()]
    return int(digits[-1]) if digits else None
