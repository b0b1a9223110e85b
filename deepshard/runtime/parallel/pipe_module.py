"""DeepSpeed's ``PipelineModule``: a model given as a list of layers, cut into stages.

A user describes the model as a sequence of layers, each fed the previous one's output
(``nn.Module`` instances, :class:`LayerSpec` blueprints, :class:`TiedLayerSpec` shared
blueprints, or plain callables such as lambdas). :class:`PipelineModule` splits the
sequence into contiguous stages (:mod:`.partition`) and builds only the layers of its own
stage: a blueprint owned by another stage is never built for real, its parameters are
counted on the ``meta`` device.

Tied layers (``TiedLayerSpec`` with one ``key``, e.g. the input embedding and the output
projection of a language model) are one module per stage that holds any of them; the
stages holding a key each keep a replica, and the engine keeps the replicas equal by
summing their gradients over those stages after backward (:mod:`.tied`).

No process group is created here: the module is usable with no ``torch.distributed`` at
all when given ``stage_id`` (tests, tools), and otherwise reads its stage from a
:class:`~.topology.Topology` and the rank.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from deepshard.errors import UsageError
from deepshard.runtime.parallel.partition import check_parts, partition_layers, partition_uniform
from deepshard.runtime.parallel.topology import Topology

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "layer_name", "layer_weights"]

logger = logging.getLogger(__name__)
WHERE = "PipelineModule"


class LayerSpec:
    """The blueprint of one layer: ``typename(*module_args, **module_kwargs)``, built only
    by the stage that owns it. Treat as immutable."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise UsageError(f"LayerSpec needs an nn.Module subclass, got {typename!r}",
                             where="LayerSpec",
                             hint="pass the class itself (LayerSpec(nn.Linear, 4, 4)), or put "
                                  "a plain function in the layer list without a LayerSpec")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        """Construct the layer (on torch's current default device)."""
        if log:
            logger.info("building %r", self)
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every spec with the same ``key``.

    ``forward_fn(module, x)``, when given, is called instead of ``module(x)`` (e.g. to
    use an embedding's weight as the output projection). ``tied_weight_attr`` names the
    shared parameters (dotted paths allowed; a string or a list of them).
    """

    def __init__(self, key: str, typename: type[nn.Module], *module_args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None,
                 tied_weight_attr: str | Iterable[str] = "weight", **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else tied_weight_attr
        self.tied_weight_attr: tuple[str, ...] = tuple(attrs)


def layer_name(layer: Any) -> str | None:
    """The class name a ``type:`` partition regex is matched against (None: unnamed)."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _count_params(layer: Any) -> int:
    """Trainable parameters of one layer, building a blueprint on ``meta`` (no memory, no
    initialisation) or, if its constructor cannot run there, on the CPU."""
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                module = layer.build()
        except Exception as exc:  # e.g. a constructor that reads tensor values
            logger.debug("counting %r on the CPU: meta build failed (%s)", layer, exc)
            module = layer.build()
    elif isinstance(layer, nn.Module):
        module = layer
    else:
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def layer_weights(layers: list[Any], method: str) -> list[int] | None:
    """Each layer's weight for ``partition_method`` (``None`` for ``"uniform"``):
    trainable parameter counts for ``"parameters"``, 1 for a layer whose class name
    matches ``<regex>`` (case-insensitive ``re.search``) for ``"type:<regex>"``."""
    lowered = method.lower()
    if lowered == "uniform":
        return None
    if lowered == "parameters":
        return [_count_params(layer) for layer in layers]
    if lowered.startswith("type:"):
        pattern = method[len("type:"):]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise UsageError(f"partition_method {method!r}: bad regular expression ({exc})",
                             where=f"{WHERE}(partition_method=...)",
                             hint="write type:<regex>, e.g. type:TransformerLayer") from None
        weights = [int(bool((name := layer_name(x)) and regex.search(name))) for x in layers]
        if not any(weights):
            names = sorted({n for n in map(layer_name, layers) if n})
            raise UsageError(f"partition_method {method!r} matches no layer",
                             where=f"{WHERE}(partition_method=...)",
                             hint=f"the layers' class names are {', '.join(names)}")
        return weights
    raise UsageError(f"unknown partition_method {method!r}", where=f"{WHERE}(partition_method"
                     "=...)", hint="use 'parameters', 'uniform' or 'type:<regex>'")


class PipelineModule(nn.Module):
    """One pipeline stage of a model given as a sequence of layers (DeepSpeed's signature).

    Args:
        layers: the layers, in order (``nn.Module``, :class:`LayerSpec`,
            :class:`TiedLayerSpec` or a callable); ``nn.Sequential`` works too.
        num_stages: pipeline stages; or give ``topology``.
        topology: the job's :class:`Topology`; its ``pipe`` size is the stage count.
        loss_fn: ``loss_fn(outputs, labels)``, applied by the engine on the last stage.
        seed_layers: seed torch with ``base_seed + layer index`` (or call
            ``seed_fn(base_seed + index)``) before building each layer, so that a layer's
            initial weights do not depend on which stage builds it.
        partition_method: ``"parameters"`` (balance trainable parameters), ``"uniform"``
            (balance layer counts) or ``"type:<regex>"`` (balance the layers whose class
            name matches).
        activation_checkpoint_interval: checkpoint every this many layers (0: never).
        activation_checkpoint_func: ``func(function, *args)``; default torch's
            ``checkpoint(use_reentrant=False)``.
        checkpointable_layers: class names eligible for checkpointing; default: a chunk
            is checkpointed when one of its layers has parameters.
        dynamic_shape: accepted for DeepSpeed compatibility; no effect.
        stage_id: this module's stage, for use without ``torch.distributed``.
        rank: this process's global rank (default ``torch.distributed.get_rank()``), when
            the stage comes from ``topology``.

    The module is built on torch's default device; moving it is the engine's job.
    """

    def __init__(self, layers: Iterable[Any], num_stages: int | None = None,
                 topology: Topology | None = None, loss_fn: Callable | None = None,
                 seed_layers: bool = False, seed_fn: Callable[[int], Any] | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None,
                 checkpointable_layers: list[str] | None = None, dynamic_shape: bool = False,
                 *, stage_id: int | None = None, rank: int | None = None):
        super().__init__()
        specs = list(layers)
        stages, stage, topo = _placement(num_stages, topology, stage_id, rank)
        if not specs:
            raise UsageError("no layers given", where=WHERE, hint="pass a list of layers")
        check_parts(len(specs), stages, where=f"{WHERE}(num_stages={stages})")
        if activation_checkpoint_interval < 0:
            raise UsageError(f"activation_checkpoint_interval must be >= 0, got "
                             f"{activation_checkpoint_interval}", where=WHERE,
                             hint="0 turns activation checkpointing off")
        weights = layer_weights(specs, partition_method)
        self.parts = (partition_uniform(len(specs), stages) if weights is None
                      else partition_layers(weights, stages))
        self.num_stages, self.stage_id, self._topo = stages, stage, topo
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self._layer_specs = specs
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, tuple[str, ...]] = {}
        self.forward_funcs: list[Callable] = []
        seed = (seed_fn or torch.manual_seed) if seed_layers else None
        for index in self.stage_layers:
            if seed is not None:
                seed(base_seed + index)
            self.forward_funcs.append(self._build_layer(index, specs[index]))

    def _build_layer(self, index: int, layer: Any) -> Callable:
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            return module if layer.forward_fn is None else functools.partial(
                layer.forward_fn, module)
        if isinstance(layer, LayerSpec):
            layer = layer.build()
        if isinstance(layer, nn.Module):
            self.add_module(str(index), layer)
            return layer
        if not callable(layer):
            raise UsageError(f"layer {index} is a {type(layer).__name__}, not a module or a "
                             f"callable", where=f"{WHERE}(layers=...)",
                             hint="use nn.Module instances, LayerSpec/TiedLayerSpec or "
                                  "functions")
        return layer

    # Placement (pure information) ---------------------------------------------------------

    @property
    def stage_layers(self) -> range:
        """Global indices of this stage's layers."""
        return range(self.parts[self.stage_id], self.parts[self.stage_id + 1])

    def partitions(self) -> tuple[int, ...]:
        """Stage boundaries: stage ``s`` owns layers ``parts[s]:parts[s + 1]``."""
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that owns global layer ``layer_idx``."""
        if not 0 <= layer_idx < len(self._layer_specs):
            raise ValueError(f"layer {layer_idx} outside 0..{len(self._layer_specs) - 1}")
        return next(s for s in range(self.num_stages) if layer_idx < self.parts[s + 1])

    def tied_groups(self) -> dict[str, tuple[int, ...]]:
        """For every tied key in the whole model (sorted): the stages holding a replica.
        Same on every stage."""
        holders: dict[str, set[int]] = {}
        for index, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                holders.setdefault(layer.key, set()).add(self.stage_owner(index))
        return {key: tuple(sorted(holders[key])) for key in sorted(holders)}

    @property
    def tied_keys(self) -> tuple[str, ...]:
        """The tied keys this stage holds a replica of (sorted)."""
        return tuple(sorted(self.tied_modules.keys()))

    def tied_weights(self) -> dict[str, tuple[nn.Parameter, ...]]:
        """This stage's shared parameters by tied key (sorted keys, attribute order)."""
        return {key: tuple(_getattr_path(self.tied_modules[key], attr)
                           for attr in self.tied_weight_attrs[key]) for key in self.tied_keys}

    def topology(self) -> Topology | None:
        """The topology the stage was placed by (None when given ``stage_id`` alone)."""
        return self._topo

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    # Compute --------------------------------------------------------------------------------

    def forward(self, forward_input: Any) -> Any:
        """Run this stage's layers, each on the previous one's output, checkpointing every
        ``activation_checkpoint_interval`` layers whose chunk is checkpointable."""
        funcs, interval = self.forward_funcs, self.activation_checkpoint_interval
        if not interval:
            return _run(funcs, forward_input)
        x = forward_input
        for start in range(0, len(funcs), interval):
            chunk = funcs[start:start + interval]
            if self._checkpointable(chunk):
                x = self._checkpoint(functools.partial(_run, chunk), x)
            else:
                x = _run(chunk, x)
        return x

    def _checkpoint(self, function: Callable, x: Any) -> Any:
        if self.activation_checkpoint_func is None:
            return torch.utils.checkpoint.checkpoint(function, x, use_reentrant=False)
        return self.activation_checkpoint_func(function, x)

    def _checkpointable(self, chunk: list[Callable]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in chunk)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters())
                   for f in chunk)


def _run(funcs: list[Callable], x: Any) -> Any:
    for f in funcs:
        x = f(x)
    return x


def _getattr_path(module: nn.Module, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _placement(num_stages: int | None, topology: Topology | None, stage_id: int | None,
               rank: int | None) -> tuple[int, int, Topology | None]:
    """(stages, this stage, topology) from the constructor's arguments."""
    if num_stages is None and topology is None:
        raise UsageError("give num_stages or topology", where=WHERE,
                         hint="PipelineModule(layers, num_stages=2)")
    if topology is not None and num_stages is not None and topology.pipe != num_stages:
        raise UsageError(f"num_stages={num_stages} but the topology has {topology.pipe} "
                         f"pipeline stages", where=WHERE, hint="give only one of the two")
    stages = topology.pipe if topology is not None else num_stages
    assert stages is not None
    if stage_id is not None:
        if not 0 <= stage_id < stages:
            raise UsageError(f"stage_id {stage_id} outside 0..{stages - 1}", where=WHERE,
                             hint=f"give a stage between 0 and {stages - 1}")
        return stages, stage_id, topology
    if topology is None or rank is None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise UsageError("torch.distributed is not initialised, so this process's stage "
                             "is unknown", where=WHERE,
                             hint="call deepshard.init_distributed() first, or pass "
                                  "stage_id=... (and num_stages) to build one stage by hand")
        if topology is None:
            topology = Topology.from_config(dist.get_world_size(), stages, 1)
        if rank is None:
            rank = dist.get_rank()
    return stages, topology.coord(rank).pipe, topology

