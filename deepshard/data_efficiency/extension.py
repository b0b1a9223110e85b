"""Data efficiency's hook into the runtime (the ``deepshard.extensions`` entry point
``data_efficiency``): the config's ``random_ltd_layer_id`` layers made to drop tokens when
the model is prepared, and the engine's :class:`~deepshard.data_efficiency.feature.DataEfficiency`
(curriculum loader, random-LTD schedule, their checkpoint states, DeepSpeed's engine
methods)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from deepshard.data_efficiency import feature
from deepshard.runtime.extensions import Extension


def _convert_layers(module: torch.nn.Module, cfg: Any, group: Any, rank: int
                    ) -> dict[int, torch.nn.Parameter]:
    """Patch the chosen layers in place (names and parameters unchanged), unless the
    script converted the model itself (``convert_to_random_ltd``)."""
    del group
    ltd = cfg.data_efficiency.data_routing.random_ltd
    if not ltd.enabled:
        return {}
    from deepshard.data_efficiency.random_ltd import convert_layers_by_id, token_drop_of

    if not any(token_drop_of(m) is not None for m in module.modules()):
        convert_layers_by_id(module, ltd.random_ltd_layer_id)
        if rank == 0:
            logging.getLogger("deepshard").info("random-LTD: layers %s of %s drop tokens",
                                                ltd.random_ltd_layer_id,
                                                type(module).__name__)
    return {}


def _export(name: str) -> Callable[..., Any]:
    def call(engine: Any, *args: Any) -> Any:
        found = next((f for f in engine.features if f.name == feature.NAME), None)
        if found is None:
            return None  # as DeepSpeed: no curriculum loader, nothing to set
        return getattr(found, name)(*args)
    return call


EXTENSION = Extension(
    name="data_efficiency", sections=("data_efficiency",), before_layout=_convert_layers,
    attach=feature.attach,
    engine_exports={name: _export(name) for name in (
        "set_data_post_process_func", "set_custom_curriculum_learning_schedule",
        "random_ltd_initialize")})
