"""The layer table (``docs/architecture.md``): which deepshard package may import which.

A package imports only its own layer or those below it; the launcher stands apart and may
import only the leaves and the config (it never imports torch). Imports are read from the
source with ``ast`` as :mod:`tests.unit.test_structure` reads them: function-local imports
count, ``TYPE_CHECKING`` imports do not. Where a lower layer needs a higher one (the
runtime saving in HF format, writing monitor events, applying sequence parallelism), the
feature registers with the runtime (``deepshard/runtime/extensions.py``), never the reverse.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_structure import PACKAGE, import_graph

LAYERS: dict[str, int] = {
    # 1 leaves: no torch, no other layer
    "deepshard": 1, "errors": 1, "contract": 1, "hostlist": 1, "liveness": 1,
    "elasticity": 1,
    # 2 the ds_config, torch-free so the launcher may read it
    "config": 2,
    # 3 communication, devices and kernels
    "comm": 3, "accelerator": 3, "kernels": 3,
    # 4 the runtime: engine, strategies, ZeRO, parallelism, checkpoints, optimizers
    "runtime": 4,
    # 5 features, each plugging into the runtime through runtime/extensions.py
    "moe": 5, "sequence": 5, "monitor": 5, "integrations": 5, "data_efficiency": 5,
    "inference": 5,
    # 6 every DeepSpeed-shaped path
    "compat": 6,
}
"""Each top-level package (or module) of ``deepshard`` and its layer."""

APART = {"launcher": {1, 2}}
"""Packages outside the ladder and the layers they may import."""

EXCEPTIONS = {
    ("deepshard.launcher.report.collect", "deepshard.kernels"):
        "ds_report lists the kernel registry (torch-free: it looks for CuPy and nvcc without "
        "importing either) while it diagnoses the install",
}
"""Single module-to-module imports the table allows anyway, each with its reason."""


def package_of(module: str) -> str:
    """``deepshard.runtime.zero.init`` -> ``runtime``; the root package is ``deepshard``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import the table forbids, as ``importer -> imported (why)``."""
    bad = []
    for importer, targets in sorted(graph.items()):
        src = package_of(importer)
        for target in sorted(targets):
            dst = package_of(target)
            if dst == src or (importer, target) in EXCEPTIONS:
                continue
            if src in APART:
                allowed = LAYERS.get(dst) in APART[src]
            else:
                allowed = dst not in APART and LAYERS[dst] <= LAYERS[src]
            if not allowed:
                bad.append(f"  {importer} -> {target} ({src} may not import {dst})")
    return bad


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in import_graph(PACKAGE)}
    assert packages - set(LAYERS) - set(APART) == set(), "add each new package to LAYERS"


def test_no_package_imports_upward():
    bad = upward_imports(import_graph(PACKAGE))
    assert not bad, "imports against the layer table (docs/architecture.md):\n" + "\n".join(bad)


def test_the_checker_catches_an_upward_and_a_launcher_import(tmp_path: Path):
    graph = {"deepshard.runtime.engine": {"deepshard.moe.layer", "deepshard.comm.p2p"},
             "deepshard.moe.layer": {"deepshard.runtime.engine"},
             "deepshard.launcher.cli": {"deepshard.config", "deepshard.runtime.api"},
             "deepshard.config": {"deepshard.launcher.cli"}}
    assert upward_imports(graph) == [
        "  deepshard.config -> deepshard.launcher.cli (config may not import launcher)",
        "  deepshard.launcher.cli -> deepshard.runtime.api (launcher may not import runtime)",
        "  deepshard.runtime.engine -> deepshard.moe.layer (runtime may not import moe)"]


def test_ruff_and_mypy_see_every_file_of_the_package():
    """No exclude pattern of ruff matches a folder or file of ``deepshard/`` (``build`` once
    hid ``runtime/build`` from it), and mypy's ``files`` is the whole package."""
    import fnmatch

    import tomllib

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    excluded = config["tool"]["ruff"].get("exclude", [])
    hidden = [str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*")
              if "__pycache__" not in path.parts
              and any(fnmatch.fnmatch(part, pattern) for pattern in excluded
                      for part in path.relative_to(PACKAGE.parent).parts)]
    assert not hidden, f"ruff's exclude hides {hidden}"
    assert config["tool"]["mypy"]["files"] == ["deepshard"]


# ---- facades define nothing -------------------------------------------------------------


def _defines_something(source: str) -> bool:
    """Whether a module body holds anything but its docstring, imports and ``__all__``."""
    import ast

    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
                "__all__"]:
            continue
        return True
    return False


def facade_packages(package_dir: Path) -> list[str]:
    """Packages none of whose modules defines anything: re-export trees, whose DeepSpeed
    names belong in ``deepshard/compat/paths.py`` instead (the shim's own empty package
    aside)."""
    found = []
    for init in sorted(package_dir.rglob("__init__.py")):
        here = init.parent
        if "shim" in here.relative_to(package_dir).parts:
            continue
        sources = [p.read_text() for p in here.rglob("*.py")]
        if not any(_defines_something(s) for s in sources):
            found.append(str(here.relative_to(package_dir.parent)))
    return found


def test_no_package_is_a_facade():
    found = facade_packages(PACKAGE)
    assert not found, ("packages that only re-export: make their DeepSpeed names rows of "
                       "deepshard/compat/paths.py\n  " + "\n  ".join(found))


@pytest.mark.parametrize(("files", "expected"), [
    ({"pkg/__init__.py": '"""Doc."""\nfrom pkg.real import X\n__all__ = ["X"]\n',
      "pkg/real.py": "X = 1\n"}, []),
    ({"pkg/__init__.py": '"""Doc."""\n', "pkg/sub/__init__.py": "from os import path\n",
      "pkg/sub/mod.py": "from os import sep as SEP\n__all__ = ['SEP']\n",
      "pkg/other.py": "def f():\n    pass\n"}, ["pkg/sub"]),
])
def test_the_facade_finder(tmp_path: Path, files: dict[str, str], expected: list[str]):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert facade_packages(tmp_path / "pkg") == expected
