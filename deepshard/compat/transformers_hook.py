"""Under the compat path, transformers' own ``HfDeepSpeedConfig`` also reaches deepshard's
sliced ZeRO-3 loader.

transformers registers the live DeepSpeed config when its ``HfDeepSpeedConfig`` is built
(in ``transformers.integrations.deepspeed``; the ``TrainingArguments``' and Accelerate's
plugin's are ones). Once ``import deepspeed`` is deepshard
(:func:`deepshard.compat.alias.install`), that class's ``__init__`` is wrapped so each
registration is also deepshard's (:func:`deepshard.integrations.hf_loading.register`): at stage 3,
``from_pretrained`` then reads each rank's slices of the checkpoint instead of every tensor
whole on every rank. When that transformers module is not imported yet, a finder wraps it
as it is (nothing of transformers or torch is imported here before that).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

MODULE = "transformers.integrations.deepspeed"
_MARK = "_deepshard_compat"


def adopt() -> None:
    """Wrap transformers' registration now, or as soon as its module is imported."""
    module = sys.modules.get(MODULE)
    if module is not None:
        _wrap(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _wrap(module: ModuleType) -> None:
    cls = module.HfDeepSpeedConfig
    original = cls.__init__
    if getattr(original, _MARK, False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if module._hf_deepspeed_config_weak_ref is not None and \
                module._hf_deepspeed_config_weak_ref() is self:
            _register(module, self)

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__
    ref = module._hf_deepspeed_config_weak_ref
    live = ref() if ref is not None else None
    if live is not None and hasattr(live, "is_zero3"):
        try:
            live.is_zero3()
        except AttributeError:  # still being built: transformers' own path loads it
            return
        _register(module, live)


def _register(module: ModuleType, config: Any) -> None:
    from deepshard.integrations import hf_loading

    hf_loading.register(config, transformers_own=module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps :data:`MODULE` when it is imported (then steps aside)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _WrappingLoader(spec.loader)
        return spec


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _wrap(module)
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
