"""``deepshard.ops`` and ``deepshard.runtime.fp16`` are DeepSpeed's module paths and nothing
else: their modules hold a docstring and imports from :mod:`deepshard.runtime.optim`, listed in
``__all__``; every class is defined there."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import deepshard

ROOT = Path(deepshard.__file__).parent
FACADES = sorted(p for d in ("ops", "runtime/fp16") for p in (ROOT / d).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("path", FACADES, ids=_module_name)
def test_facade_modules_only_reexport(path):
    tree = ast.parse(path.read_text())
    imported: set[str] = set()
    exported: list[str] = []
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom):
            assert node.module and node.module.startswith("deepshard.runtime.optim"), (
                f"{path}: imports from {node.module}")
            imported.update(alias.asname or alias.name for alias in node.names)
            continue
        assert isinstance(node, ast.Assign) and [t.id for t in node.targets
                                                 if isinstance(t, ast.Name)] == ["__all__"], (
            f"{path}:{node.lineno}: only imports and __all__ belong in a re-export module")
        exported = ast.literal_eval(node.value)
    assert sorted(exported) == sorted(imported)
    module = importlib.import_module(_module_name(path))
    for name in exported:
        assert getattr(module, name).__module__.startswith("deepshard.runtime.optim")


def test_deepspeed_names_are_the_runtime_classes():
    from deepshard.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepshard.ops.lamb import FusedLamb
    from deepshard.runtime import optim
    from deepshard.runtime.fp16.onebit.adam import OnebitAdam
    from deepshard.runtime.fp16.onebit.lamb import OnebitLamb
    from deepshard.runtime.fp16.onebit.zoadam import ZeroOneAdam

    assert (FusedAdam, DeepSpeedCPUAdam, FusedLamb) == (
        optim.FusedAdam, optim.DeepSpeedCPUAdam, optim.FusedLamb)
    assert (OnebitAdam, OnebitLamb, ZeroOneAdam) == (
        optim.onebit.OneBitAdam, optim.onebit.OneBitLamb, optim.onebit.ZeroOneAdam)
