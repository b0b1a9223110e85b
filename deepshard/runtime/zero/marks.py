"""What a user marks on a model for ZeRO-3, with DeepSpeed's functions: *leaf* modules and
*external* parameters. Both are read when stage 3 cuts the model into units
(:func:`deepshard.runtime.zero.stage3.plan_units`), so they must be set before
``initialize``.

- A leaf module (``set_z3_leaf_modules(model, [MixtralSparseMoeBlock])``, DeepSpeed's
  ``deepspeed.utils``) is gathered whole, its subtree at once: a unit never lies inside it.
  For MoE blocks, whose experts run in a data-dependent order, and for modules too
  fine-grained for per-module hooks.
- An external parameter (``register_external_parameter(module, p)``, DeepSpeed's
  ``deepspeed.zero``) is one that ``module``'s forward uses although another module owns
  it (transformers' audio models use a convolution's weight so): its unit is then the
  root's, which stays gathered around every other unit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["external_parameters", "get_z3_leaf_modules", "register_external_parameter",
           "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unregister_external_parameter",
           "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]


def z3_leaf_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is marked as a ZeRO-3 leaf."""
    return bool(getattr(module, "_z3_leaf", False))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` belongs to a leaf module of an engine's model."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` marked as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(module: torch.nn.Module, flag: bool) -> None:
    """Mark (or unmark) one module as a leaf."""
    module._z3_leaf = flag


def _matches(module: torch.nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set_by_class(model: torch.nn.Module, classes: Sequence[type | str], flag: bool,
                  raise_if_not_found: bool) -> list[torch.nn.Module]:
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must be classes or class names, got {bad!r}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for m in found:
        m._z3_leaf = flag
    if not found and raise_if_not_found:
        raise ValueError(f"no modules of type {list(classes)} found in the model")
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[type | str],
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Mark every module of ``model`` that is an instance of one of ``leaf_module_classes``
    (classes, or class names: short or fully qualified) as a leaf; returns them. Raises
    ``ValueError`` when none matches (unless ``raise_if_not_found`` is False)."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[type | str],
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Undo :func:`set_z3_leaf_modules` for those classes; returns the modules."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: Sequence[str],
                                flag: bool = True, raise_if_not_found: bool = True
                                ) -> tuple[list[torch.nn.Module], list[str]]:
    """Mark the modules named (as ``named_modules()`` names them); returns them and the
    names not found (a ``ValueError`` when any is missing, unless told not to)."""
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    for m in found:
        m._z3_leaf = flag
    if missing and raise_if_not_found:
        raise ValueError(f"no modules named {missing} found in the model")
    return found, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: Sequence[str],
                                  flag: bool = True, raise_if_not_found: bool = True
                                  ) -> tuple[list[torch.nn.Module], list[str]]:
    """Mark the modules whose name ends with one of the suffixes; returns them and the
    suffixes that matched nothing."""
    named = list(model.named_modules())
    found: dict[int, torch.nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [m for n, m in named if n.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for m in hits:
            m._z3_leaf = flag
            found.setdefault(id(m), m)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules matching suffixes {missing} found in the model")
    return list(found.values()), missing


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter
                                ) -> None:
    """Tell ZeRO-3 that ``module``'s forward uses ``parameter``, which another module owns
    (DeepSpeed's ``deepspeed.zero.register_external_parameter``). Before ``initialize``."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("parameter must be a torch.nn.Parameter")
    external = module.__dict__.setdefault("_external_params", {})
    external[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter
                                  ) -> None:
    """Undo :func:`register_external_parameter`; a ``RuntimeError`` when it was not."""
    external = module.__dict__.get("_external_params", {})
    if id(parameter) not in external:
        raise RuntimeError("Parameter is not a registered external parameter of module.")
    del external[id(parameter)]


def external_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters registered as external to ``module`` (not its subtree's)."""
    return list(module.__dict__.get("_external_params", {}).values())
