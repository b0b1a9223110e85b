"""The package's shape, read from its source with ``ast`` (nothing of deepshard or torch is
imported): no import cycle among ``deepshard`` modules, and no function longer than
:data:`MAX_LINES` code lines (STYLE.md, practice 1).

Imports counted: every ``import``/``from ... import`` statement, at module level or inside a
function or class, absolute or relative (resolved against the importing module's package).
``from pkg import name`` is an import of ``pkg.name`` when that is a module or package, else
of ``pkg``; importing a package means importing its ``__init__``. Not counted: imports under
``if TYPE_CHECKING:`` (never executed), ``importlib.import_module`` and PEP 562 lazy
attributes (names, not statements), and the parent packages' ``__init__`` that Python runs
before a submodule (a package is always partly initialised before its children, so those
edges would make every package a "cycle").
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "deepshard"
MAX_LINES = 60


# ---- modules and their imports ----


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file under ``package_dir``
    (a package is named by its ``__init__.py``)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, nested ones included, except under TYPE_CHECKING."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is a known module; None outside the set."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, source: str, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``module`` (whose code is ``source``) imports."""
    is_package = modules[module].name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
            for base in bases:
                targets.add(_resolve(base, modules) or "")
            continue
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)] if node.level > 1 else anchor
            base = ".".join([*anchor, node.module] if node.module else anchor)
        else:
            base = node.module or ""
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            targets.add(sub if sub in modules else (_resolve(base, modules) or ""))
    targets.discard("")
    targets.discard(module)
    return targets


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    modules = module_files(package_dir)
    return {name: imports_of(name, path.read_text(), modules) for name, path in modules.items()}


# ---- cycles ----


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of ``graph`` (iterative), each sorted; singletons left out
    unless a module imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    components.append(sorted(component))
    return sorted(components)


def _shortest_cycle_through(start: str, graph: dict[str, set[str]], within: set[str]
                            ) -> list[str]:
    """The shortest ``start -> ... -> start`` chain inside ``within`` (BFS)."""
    parent: dict[str, str] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        node = queue.popleft()
        for child in sorted(graph.get(node, ())):
            if child == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(parent[chain[-1]])
                return [*reversed(chain), start]
            if child in within and child not in seen:
                seen.add(child)
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is on no cycle")


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """For each cyclic component, the shortest cycle through each of its modules (so every
    module on a cycle shows in one), rotated to start at its smallest name, deduplicated."""
    cycles: set[tuple[str, ...]] = set()
    for component in strongly_connected(graph):
        members = set(component)
        for module in component:
            chain = _shortest_cycle_through(module, graph, members)[:-1]
            first = chain.index(min(chain))
            rotated = chain[first:] + chain[:first]
            cycles.add((*rotated, rotated[0]))
    return sorted(list(c) for c in cycles)


# ---- function length ----


def _code_lines(source: str) -> set[int]:
    """Line numbers holding code: covered by a token that is not a comment or whitespace."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[int, str, int]]:
    """``(line, qualified name, code lines)`` of each function or method in ``source`` whose
    body has more than ``limit`` code lines: not blank, not comments, not the docstring.
    A nested function's lines count for it and for the function around it."""
    code = _code_lines(source)
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = f"{prefix}{getattr(child, 'name', '')}"
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = child.body
                first = body[0]
                start = min([first.lineno, *(d.lineno for d in
                                             getattr(first, "decorator_list", []))])
                lines = set(range(start, child.end_lineno + 1)) & code
                if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                        and isinstance(first.value.value, str)):
                    lines -= set(range(first.lineno, first.end_lineno + 1))
                if len(lines) > limit:
                    found.append((child.lineno, name, len(lines)))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return sorted(found)


# ---- the checks on deepshard ----


def test_no_import_cycle_in_deepshard():
    cycles = import_cycles(import_graph(PACKAGE))
    assert not cycles, "import cycles (function-local imports included):\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in cycles)


def test_no_function_in_deepshard_is_longer_than_the_limit():
    too_long = [
        f"  {path.relative_to(ROOT)}:{line} {name} ({n} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, name, n in long_functions(path.read_text())
    ]
    assert not too_long, (f"functions over {MAX_LINES} code lines (STYLE.md practice 1):\n"
                          + "\n".join(too_long))


def test_this_module_imports_neither_torch_nor_deepshard():
    imported = {alias.name.split(".")[0] for node in _import_nodes(ast.parse(
        Path(__file__).read_text())) for alias in getattr(node, "names", [])}
    imported |= {node.module.split(".")[0] for node in _import_nodes(ast.parse(
        Path(__file__).read_text())) if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"torch", "deepshard"}


# ---- the checkers on synthetic packages ----


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_cycle_finder_resolves_relative_local_and_submodule_imports(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from .sub import b\n",     # function-local, submodule name
        "pkg/sub/__init__.py": "from .b import thing\n",          # package -> its module
        "pkg/sub/b.py": "from ..c import helper\n",               # two levels up
        "pkg/c.py": "import pkg.a\n",                             # absolute: closes a->b->c->a
        "pkg/d.py": "from pkg import sub\n",                      # package import: sub/__init__
        "pkg/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n",
        "pkg/f.py": "import os\nfrom pkg.c import helper\n",      # outside names ignored
    })
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.sub"}
    assert graph["pkg.e"] == set()
    assert graph["pkg.f"] == {"pkg.c"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_cycle_finder_reports_every_module_of_a_tangle_and_no_acyclic_one(tmp_path):
    graph = {"x": {"y"}, "y": {"x", "z"}, "z": {"y"}, "w": {"x"}, "s": {"s"}}
    assert import_cycles(graph) == [["s", "s"], ["x", "y", "x"], ["y", "z", "y"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    pkg = _write(tmp_path, {"pkg/__init__.py": "from pkg import m\n",
                            "pkg/m.py": "from pkg import VALUE\n"})  # a name of the package
    assert import_cycles(import_graph(pkg)) == [["pkg", "pkg.m", "pkg"]]


def test_line_counter_skips_blanks_comments_and_the_docstring():
    body = "\n".join(f"    x{i} = {i}  # c" for i in range(60))
    source = (
        "@decorator\n"
        "def fits(a,\n"
        "         b):\n"
        '    """Doc\n\n    string."""\n'
        "    # a comment\n\n"
        f"{body}\n"
        "\n"
        "class K:\n"
        "    def method(self):\n"
        f"{body}\n"
        "        s = '''two\n# not a comment\n'''\n"
        "        def inner():\n"
        "            return 1\n"
    )
    source = source.replace("    def method(self):\n" + body,
                            "    def method(self):\n" + body.replace("    ", "        "))
    assert long_functions(source) == [(71, "K.method", 65)]
    assert long_functions(source, limit=59) == [(2, "fits", 60), (71, "K.method", 65)]
    assert long_functions("def f(): return 1\n", limit=0) == [(1, "f", 1)]
