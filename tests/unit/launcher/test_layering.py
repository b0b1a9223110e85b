"""The launcher's layering: no import cycles, and no torch (DESIGN.md, "Layers")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import deepshard

PACKAGE = Path(deepshard.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """deepshard modules ``path`` imports anywhere: inside functions and TYPE_CHECKING too."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level \
                else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    # a package's own __init__ (run by every import of a submodule) is no edge of the cycle
    return {m for m in found if m in known and m != name and not name.startswith(m + ".")}


def _graph() -> dict[str, set[str]]:
    paths = [*(PACKAGE / "launcher").rglob("*.py"), PACKAGE / "contract.py"]
    known = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, known) for p in paths}


def test_no_import_cycle_in_the_launcher_and_contract():
    graph = _graph()
    assert "deepshard.launcher.spawn" in graph and graph["deepshard.launcher.spawn"] == set()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(
                [*path[path.index(dep):], dep] if dep in path else [*path, dep])
            if dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_contract_and_spawn_are_leaves():
    graph = _graph()
    assert graph["deepshard.contract"] == set()
    assert graph["deepshard.launcher.spawn"] == set()


def test_no_launcher_module_imports_torch():
    names = sorted(_graph())
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
