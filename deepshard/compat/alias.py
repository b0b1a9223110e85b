"""``deepspeed`` → ``deepshard``: the work behind the shim package, importable and testable alone.

:func:`install` makes ``sys.modules["deepspeed"]`` the deepshard module and puts
:class:`AliasFinder` first on ``sys.meta_path``: ``deepspeed.x.y`` is then the module object
deepshard module the path table (:mod:`.paths`) names for it (one module under two names, so
``isinstance`` checks and module state agree: ``deepspeed.zero`` is ``deepshard.runtime.zero``),
or a package built from the table's name rows (``deepspeed.pipe``, ``deepspeed.utils``). A
``deepspeed.X`` deepshard lacks raises
:class:`~.missing.MissingDeepSpeedModule`, and the exit hooks make an uncaught one a single
line with exit code 2. Where a real DeepSpeed is installed as well, deepshard still wins and
rank 0 logs one warning. Installing imports deepshard's ``__init__`` only: no torch.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any, cast

from deepshard import contract
from deepshard.compat import paths
from deepshard.compat.missing import attribute_error, module_error
from deepshard.contract import SHIM_DIR
from deepshard.errors import install_exit_hooks

ALIAS = paths.ALIAS
TARGET = paths.TARGET

if TYPE_CHECKING:  # typing, collections.abc and importlib.abc cost ~50 ms in every worker
    from collections.abc import Callable, Sequence
    from importlib.abc import Loader
    from types import ModuleType
    from typing import Any


def target_name(name: str) -> str:
    """The deepshard module behind ``name`` (``deepspeed`` or ``deepspeed.x.y``): the path
    table's row (:func:`.paths.target_name`)."""
    return paths.target_name(name)


def _exists(real: str) -> bool:
    """Whether deepshard has module ``real``, without running it (its parents may run)."""
    if real in sys.modules:
        return True
    try:
        return importlib.util.find_spec(real) is not None
    except ModuleNotFoundError as exc:
        # a missing deepshard parent means "not provided"; anything else is a real failure
        if exc.name and (real == exc.name or real.startswith(exc.name + ".")):
            return False
        raise


class AliasLoader:
    """Hands the import system the existing deepshard module for a ``deepspeed`` name
    (an ``importlib.abc.Loader`` by its methods; that ABC is not imported, for speed)."""

    def __init__(self, real: str):
        self.real = real
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.real)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the alias's spec on the module: give it back its own
        alias = module.__spec__.name if module.__spec__ is not None else module.__name__
        module.__spec__ = self._spec
        if hasattr(module, "__path__"):
            _submodules_as_attributes(module, alias)

    def get_code(self, fullname: str) -> Any:
        """The deepshard module's code, for ``python -m deepspeed.X`` (runpy runs it as
        ``__main__``)."""
        del fullname
        spec = importlib.util.find_spec(self.real)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
            return None
        return spec.loader.get_code(self.real)

    def is_package(self, fullname: str) -> bool:
        """Whether the deepshard module is a package (runpy asks)."""
        del fullname
        spec = importlib.util.find_spec(self.real)
        return spec is not None and spec.submodule_search_locations is not None


class BuiltLoader:
    """Makes a DeepSpeed package of :data:`.paths.NAMES` rows: an empty module whose
    attributes are imported from where each row says, on first use (a ``Loader`` by its
    methods)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default: a new, empty module

    def exec_module(self, module: ModuleType) -> None:
        rows = paths.NAMES[module.__name__]
        module.__all__ = sorted(rows)  # type: ignore[attr-defined]
        module.__doc__ = (f"{module.__name__} under --deepspeed_compat: names defined across "
                          "deepshard (deepshard.compat.paths)")

        def __getattr__(attr: str) -> Any:
            row = rows.get(attr)
            if row is not None:
                where, name = paths.split_row(row)
                return getattr(importlib.import_module(where), name)
            if not attr.startswith("__"):
                try:
                    return importlib.import_module(f"{module.__name__}.{attr}")
                except ModuleNotFoundError:
                    pass
            raise AttributeError(f"module {module.__name__!r} has no attribute {attr!r}")

        module.__getattr__ = __getattr__  # type: ignore[method-assign]


def resolve(name: str) -> Any:
    """The deepshard object a dotted DeepSpeed name (``deepspeed.pipe.LayerSpec``,
    ``deepspeed.zero``) stands for, by the path table alone: nothing is installed, and no
    ``deepspeed`` module is made. Raises ``LookupError`` for a name the table and deepshard
    lack."""
    module, _, attr = name.rpartition(".")
    if paths.is_built(module) and attr in paths.NAMES[module]:
        where, attribute = paths.split_row(paths.NAMES[module][attr])
        return getattr(importlib.import_module(where), attribute)
    if name == ALIAS or _exists(target_name(name)):
        return importlib.import_module(target_name(name))
    if module and (module == ALIAS or _exists(target_name(module))):
        found = getattr(importlib.import_module(target_name(module)), attr, None)
        if found is not None:
            return found
    raise LookupError(f"{name}: not in deepshard's DeepSpeed path table")


class AliasFinder:
    """First on ``sys.meta_path``: every ``deepspeed.*`` name resolves to deepshard (an
    ``importlib.abc.MetaPathFinder`` by its method)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        if paths.is_built(fullname):
            return importlib.machinery.ModuleSpec(fullname, cast("Loader", BuiltLoader()),
                                                  is_package=True)
        real = target_name(fullname)
        if not _exists(real):
            raise module_error(fullname)
        return importlib.machinery.ModuleSpec(fullname, cast("Loader", AliasLoader(real)))


def install(shim_dir: str = SHIM_DIR) -> ModuleType:
    """Make ``deepspeed`` deepshard in this process (idempotent); returns deepshard.

    ``shim_dir``: the directory the shim was imported from, left out when looking for a
    real DeepSpeed to warn about.
    """
    install_exit_hooks()
    deepshard = importlib.import_module(TARGET)
    sys.modules[ALIAS] = deepshard
    _present_version(deepshard)
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
        _explain_missing_attributes(deepshard)
        from deepshard.compat import transformers_hook

        transformers_hook.adopt()
        real = real_deepspeed(shim_dir)
        if real is not None and os.environ.get(contract.RANK, "0") == "0":
            import logging  # only now: ~10 ms

            logging.getLogger(__name__).warning(
                "deepshard: --deepspeed_compat: `import deepspeed` is deepshard; the "
                "DeepSpeed installed at %s is not used", real)
    return deepshard


def _present_version(deepshard: ModuleType) -> None:
    """``deepspeed.__version__`` agrees with the presented distribution
    (:mod:`.distribution`): ``0.19.8+deepshard.<deepshard's version>``, and the
    ``__version_major__``/``__git_hash__`` siblings DeepSpeed's package has. deepshard's own
    code reads its version from :data:`deepshard.contract.DEEPSHARD_VERSION`."""
    from deepshard.compat import distribution

    major, minor, patch = distribution.version_parts()
    deepshard.__version__ = distribution.version()  # type: ignore[attr-defined]
    deepshard.__version_major__ = major  # type: ignore[attr-defined]
    deepshard.__version_minor__ = minor  # type: ignore[attr-defined]
    deepshard.__version_patch__ = patch  # type: ignore[attr-defined]
    deepshard.__git_hash__ = distribution.GIT_HASH  # type: ignore[attr-defined]
    deepshard.__git_branch__ = distribution.GIT_BRANCH  # type: ignore[attr-defined]


def real_deepspeed(shim_dir: str, path: Sequence[str] | None = None) -> str | None:
    """Where a real DeepSpeed package is on ``path`` (``sys.path``), the shim left out."""
    shim = os.path.realpath(shim_dir)
    entries = [p for p in (sys.path if path is None else path)
               if os.path.realpath(p or os.curdir) != shim]
    spec = importlib.machinery.PathFinder.find_spec(ALIAS, entries)
    if spec is None:
        return None
    locations = spec.submodule_search_locations
    return next(iter(locations)) if locations else spec.origin


def _submodules_as_attributes(package: ModuleType, alias: str) -> None:
    """``deepspeed.moe.layer.MoE`` after only ``import deepspeed.moe.utils``: DeepSpeed's
    packages import their submodules eagerly, deepshard's lazily, so an attribute the
    package lacks is looked up as its submodule (imported then). The package's own
    ``__getattr__``, if any, is asked first; the module object stays the same."""
    original: Callable[[str], Any] | None = package.__dict__.get("__getattr__")
    if getattr(original, "_deepspeed_compat", False):
        return
    name = package.__name__

    def __getattr__(attr: str) -> Any:
        if original is not None:
            try:
                return original(attr)
            except AttributeError:
                pass
        if not attr.startswith("__") and _exists(f"{name}.{attr}"):
            return importlib.import_module(f"{name}.{attr}")
        child = f"{alias}.{attr}"  # deepspeed.runtime.pipe: a table row, not deepshard's
        if not attr.startswith("__") and (paths.is_built(child) or paths.module_row(child)):
            return importlib.import_module(child)
        raise AttributeError(f"module {name!r} has no attribute {attr!r}")

    __getattr__._deepspeed_compat = True  # type: ignore[attr-defined]
    package.__getattr__ = __getattr__  # type: ignore[method-assign]


def _explain_missing_attributes(deepshard: ModuleType) -> None:
    """``deepspeed.init_inference`` and the like: one line naming the closest feature.

    deepshard's own module ``__getattr__`` is wrapped in place (the module object stays the
    same, so ``deepspeed is deepshard`` holds); names it does not know keep its plain
    AttributeError.
    """
    original: Callable[[str], Any] | None = deepshard.__dict__.get("__getattr__")
    if original is None or getattr(original, "_deepspeed_compat", False):
        return

    def __getattr__(name: str) -> Any:
        try:
            return original(name)
        except AttributeError:
            alias = f"{ALIAS}.{name}"
            if not name.startswith("__") and (paths.is_built(alias)
                                              or _exists(target_name(alias))):
                return importlib.import_module(alias)  # deepspeed.moe, deepspeed.pipe
            error = attribute_error(name)
            if error is None:
                raise
            raise error from None

    __getattr__._deepspeed_compat = True  # type: ignore[attr-defined]
    deepshard.__getattr__ = __getattr__  # type: ignore[method-assign]
