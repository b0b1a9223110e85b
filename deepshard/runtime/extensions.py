"""How feature packages plug into the runtime without the runtime importing them.

The runtime (layer 4) never imports a feature package (layer 5: ``moe``, ``sequence``,
``monitor``, ``integrations``). A feature registers instead: it declares an
:class:`Extension` in its own package and names it under the ``deepshard.extensions``
entry-point group of ``pyproject.toml``; :func:`load_extensions` reads that group when
``initialize`` assembles an engine. The hooks are the only calls the runtime makes into
features.

A config section that needs a feature the installation does not register (a source tree
on ``PYTHONPATH`` with no installed metadata, say) is refused in one line by
:func:`require`, never silently skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Protocol

import torch

from deepshard.errors import UsageError

GROUP = "deepshard.extensions"
"""The entry-point group features register under."""

Event = tuple[str, Any, int]
"""A monitor event: ``(name, value, global samples)``, DeepSpeed's monitor tuple."""


class EventSink(Protocol):
    """What the engine writes its monitor events to (DeepSpeed's ``MonitorMaster``)."""

    enabled: bool
    """Whether any monitor writes (on every rank alike)."""

    @property
    def monitors(self) -> list[Any]:
        """The enabled writers on this rank (empty on ranks that do not write)."""

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Hand ``event_list`` to every enabled writer."""

    def close(self) -> None:
        """Flush and close every writer."""


class NullSink:
    """The sink of a config with no monitor enabled when no feature registers one."""

    enabled = False
    monitors: list[Any] = []  # noqa: RUF012 (read-only: never appended to)

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Nothing is written."""

    def close(self) -> None:
        """Nothing to close."""


class EngineFeature(Protocol):
    """A feature's live part of one engine (data efficiency: its curriculum sampler and
    random-LTD schedule), made by :attr:`Extension.attach` once the engine exists."""

    name: str
    """The key its state is saved under in checkpoints."""

    def before_forward(self, engine: Any) -> None:
        """Called at every ``engine(...)`` before the module's forward."""

    def training_loader(self, engine: Any, dataset: Any, collate_fn: Any) -> Any:
        """The loader ``initialize(training_data=...)`` returns, or ``None`` for the
        engine's own."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (picklable; restored by :meth:`load_state_dict`)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state_dict`."""


ModelHook = Callable[[torch.nn.Module, Any, Any, int], Mapping[int, torch.nn.Parameter]]
"""``(module, config, data-parallel group, rank) -> replaced``: changes the module in place;
returns, by the ``id`` of each parameter it replaced, the parameter standing for it."""


@dataclass(frozen=True)
class Extension:
    """One feature's hooks into the runtime; every hook is optional."""

    name: str
    """The feature's name (its entry-point name), for messages."""
    sections: tuple[str, ...] = ()
    """Config sections this feature implements (``cfg.<section>`` set -> needed)."""
    before_layout: ModelHook | None = None
    """Model preparation before the model-parallel layout (AutoEP shards HF experts)."""
    after_layout: ModelHook | None = None
    """Model preparation after the layout and before rank 0's weights are broadcast
    (sequence parallelism swaps attention)."""
    event_sink: Callable[[Any, int], EventSink] | None = None
    """``(monitor config, rank) -> sink`` for the config's monitor sections."""
    attach: Callable[[Any], EngineFeature | None] | None = None
    """``engine -> feature`` once the engine is built (``None``: the config does not ask for
    it): its forward, loader and checkpoint hooks (:class:`EngineFeature`)."""
    engine_exports: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    """Engine methods the feature implements, by name, each called with the engine
    first (``save_pretrained``)."""


@dataclass(frozen=True)
class Extensions:
    """Every registered feature, in entry-point name order."""

    items: tuple[Extension, ...] = ()

    def model_hooks(self, when: str) -> list[ModelHook]:
        """The ``before_layout`` or ``after_layout`` hooks, in order."""
        return [hook for ext in self.items if (hook := getattr(ext, when)) is not None]

    def event_sink(self, monitor_config: Any, rank: int) -> EventSink:
        """The sink of the config's monitor sections, from the first feature that makes
        one; a :class:`NullSink` when no monitor is enabled and none does; refused when one
        is enabled and none does."""
        for ext in self.items:
            if ext.event_sink is not None:
                return ext.event_sink(monitor_config, rank)
        if monitor_config.enabled:
            raise UsageError("a monitor is enabled but no installed deepshard feature "
                             "writes monitor events", where="monitor", hint=_REINSTALL)
        return NullSink()

    def attach(self, engine: Any) -> tuple[EngineFeature, ...]:
        """The features the engine's config switches on, attached to it."""
        made = (ext.attach(engine) for ext in self.items if ext.attach is not None)
        return tuple(feature for feature in made if feature is not None)

    def export(self, name: str) -> Callable[..., Any]:
        """The engine method ``name`` a feature implements; a one-line error when none
        does."""
        for ext in self.items:
            if name in ext.engine_exports:
                return ext.engine_exports[name]
        raise UsageError(f"no installed deepshard feature implements engine.{name}",
                         where=f"entry points {GROUP}", hint=_REINSTALL)

    def require(self, cfg: Any) -> None:
        """Refuse a config section set in ``cfg`` that no registered feature implements."""
        claimed = {s for ext in self.items for s in ext.sections}
        for section in NEEDS_A_FEATURE:
            if section not in claimed and _section_set(getattr(cfg, section, None)):
                raise UsageError(f"{section} is set but no installed deepshard feature "
                                 "implements it", where=section, hint=_REINSTALL)


NEEDS_A_FEATURE = ("expert_parallel", "sequence_parallel", "data_efficiency")
"""Config sections only a feature package implements (monitors are checked by their own
section: an enabled monitor with no sink registered is refused where it is built)."""

_REINSTALL = (f"reinstall deepshard (pip install -e .) so its {GROUP} entry points are "
              "registered")


def _section_set(section: Any) -> bool:
    if section is None:
        return False
    enabled = getattr(section, "any_enabled", None)
    return bool(enabled()) if callable(enabled) else bool(section)


def load_extensions(entry_points: Iterable[metadata.EntryPoint] | None = None) -> Extensions:
    """The features registered under :data:`GROUP` (``entry_points``: given, for tests),
    one per name (a package installed twice registers once)."""
    found = metadata.entry_points(group=GROUP) if entry_points is None else entry_points
    by_name: dict[str, Extension] = {}
    for point in sorted(found, key=lambda p: p.name):
        if point.name in by_name:
            continue
        extension = point.load()
        if not isinstance(extension, Extension):
            raise TypeError(f"entry point {point.name} = {point.value} is not an Extension")
        by_name[point.name] = extension
    return Extensions(tuple(by_name.values()))
