"""Which DeepSpeed names a Python file or package uses, read from its source (no import of
it), and whether deepshard resolves each: ``scripts/ds_names.py`` (the audit of issue 41)
and the ecosystem test (``tests/unit/compat/test_ecosystem_names.py``).

The HF ecosystem (transformers, accelerate, peft, trl) reaches into DeepSpeed by dotted name;
under ``--deepspeed_compat`` each of those names must resolve to deepshard. This module finds
them with the ``ast`` module alone: ``import deepspeed.x``, ``from deepspeed.x import a as b``
(module level or inside a function), and pure attribute chains on a name so bound
(``deepspeed.zero.GatheredParameters``, ``pp.zero_wrapper_for_fp_tensor_constructor`` after
``from deepspeed.runtime.zero import partition_parameters as pp``). The AST cannot tell a
module from a class, so a chain on any from-imported name is followed
(``ZeroParamStatus.AVAILABLE``), and a chain that is assigned to counts (a monkeypatch of
``pp.zero_wrapper_for_fp_tensor_constructor`` needs that name to exist).

Bindings are per scope but not flow-sensitive: an import anywhere in a function binds the name
for the whole function, as Python's own scoping does. A name bound by a non-DeepSpeed import
or a parameter shadows an outer DeepSpeed binding; where one scope binds a name both ways
(``try: from deepspeed import comm as dist`` / ``except: import torch.distributed as dist``)
the DeepSpeed binding wins. Chains through a call result (``get_accelerator().device_name``)
are not followed, and names reached only through strings (``getattr(m, "x")``,
``importlib.import_module("deepspeed.x")``) are not seen.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = "deepspeed"

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)

# Every import statement that can bind a DeepSpeed module matches (a superset: `from`/`import`
# as words anywhere, backslash continuations included); parsing only the files that match
# is what keeps reading transformers' ~3,000 files at about a second.
_GAP = r"[\s\\]"
_MAY_IMPORT = re.compile(
    rf"\bfrom{_GAP}+{ROOT}\b"
    rf"|\bimport{_GAP}+(?:[\w.]+(?:{_GAP}+as{_GAP}+\w+)?{_GAP}*,{_GAP}*)*{ROOT}\b")

Bindings = dict[str, str | None]
"""A scope's names -> the DeepSpeed dotted name each is bound to (None: bound to something
else, which shadows an enclosing DeepSpeed binding)."""


def is_deepspeed(dotted: str | None) -> bool:
    """Whether ``dotted`` is ``deepspeed`` or a name under it."""
    return dotted is not None and (dotted == ROOT or dotted.startswith(ROOT + "."))


def collect_source(source: str, filename: str) -> dict[str, list[str]]:
    """The DeepSpeed names ``source`` uses -> its ``"filename:line"`` sites, sorted by name."""
    collector = _Collector(filename)
    collector.visit(ast.parse(source, filename=filename))
    return {name: collector.found[name] for name in sorted(collector.found)}


def collect_package(directory: str | Path) -> dict[str, list[str]]:
    """The DeepSpeed names the ``.py`` files under ``directory`` use -> their sites, each
    ``"<package>/<path>:<line>"`` (relative to ``directory``'s parent), sorted by name."""
    root = Path(directory)
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8", errors="replace")
        if ROOT not in source or not _MAY_IMPORT.search(source):  # most: not worth parsing
            continue
        relative = path.relative_to(root.parent).as_posix()
        for name, sites in collect_source(source, relative).items():
            found.setdefault(name, []).extend(sites)
    return {name: found[name] for name in sorted(found)}


def _scope_nodes(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of one scope's ``body``, not descending into nested scopes."""
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _import_bindings(node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, str | None]]:
    """(local name, DeepSpeed dotted name or None) for each name ``node`` binds."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.asname:
                yield alias.asname, alias.name if is_deepspeed(alias.name) else None
            else:
                top = alias.name.split(".")[0]
                yield top, top if is_deepspeed(top) else None
        return
    from_deepspeed = node.level == 0 and is_deepspeed(node.module)
    for alias in node.names:
        if alias.name != "*":
            yield (alias.asname or alias.name,
                   f"{node.module}.{alias.name}" if from_deepspeed else None)


def _bindings(body: list[ast.stmt], parameters: ast.arguments | None) -> Bindings:
    """What one scope binds: its parameters (shadowing) and its imports."""
    bound: Bindings = {}
    if parameters is not None:
        every = [*parameters.posonlyargs, *parameters.args, *parameters.kwonlyargs,
                 *(a for a in (parameters.vararg, parameters.kwarg) if a is not None)]
        bound.update((arg.arg, None) for arg in every)
    for node in _scope_nodes(body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name, dotted in _import_bindings(node):
                if bound.get(name) is None:  # a DeepSpeed binding, once made, wins
                    bound[name] = dotted
    return bound


class _Collector(ast.NodeVisitor):
    """One file's walk: a stack of scopes, each (bindings, is a class body)."""

    def __init__(self, filename: str):
        self.filename = filename
        self.found: dict[str, list[str]] = {}
        self.scopes: list[tuple[Bindings, bool]] = []

    def record(self, name: str, node: ast.AST) -> None:
        self.found.setdefault(name, []).append(f"{self.filename}:{getattr(node, 'lineno', 0)}")

    def lookup(self, name: str) -> str | None:
        """The DeepSpeed name ``name`` is bound to here; class bodies are skipped unless
        innermost, as Python skips them."""
        for depth, (bound, is_class) in enumerate(reversed(self.scopes)):
            if is_class and depth > 0:
                continue
            if name in bound:
                return bound[name]
        return None

    def in_scope(self, body: list[ast.stmt], parameters: ast.arguments | None,
                 is_class: bool = False) -> None:
        self.scopes.append((_bindings(body, parameters), is_class))
        for statement in body:
            self.visit(statement)
        self.scopes.pop()

    def visit_Module(self, node: ast.Module) -> None:
        self.in_scope(node.body, None)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for outer in [*node.decorator_list, node.args, *([node.returns] if node.returns else [])]:
            self.visit(outer)  # evaluated in the enclosing scope
        self.in_scope(node.body, node.args)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.visit(node.args)
        self.scopes.append((_bindings([], node.args), False))
        self.visit(node.body)
        self.scopes.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for outer in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(outer)
        self.in_scope(node.body, None, is_class=True)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if is_deepspeed(alias.name):
                self.record(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level != 0 or node.module is None or not is_deepspeed(node.module):
            return
        for alias in node.names:
            self.record(node.module if alias.name == "*" else f"{node.module}.{alias.name}",
                        node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain: list[str] = []
        value: ast.expr = node
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        base = self.lookup(value.id) if isinstance(value, ast.Name) else None
        if base is None:
            self.generic_visit(node)  # a call's or subscript's attributes: look inside only
            return
        self.record(".".join([base, *reversed(chain)]), node)


# --- resolving and the command line -------------------------------------------------------------


def package_names(package: str) -> dict[str, list[str]] | None:
    """The DeepSpeed names ``package``'s installed source uses -> their sites; None when
    it is not installed. Found by spec, so the package itself is not imported."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # not a module name (a path that does not exist)
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return collect_package(Path(next(iter(spec.submodule_search_locations))))


def resolve_dotted(name: str) -> object:
    """The object ``name`` is under the alias: :func:`deepshard.compat.alias.resolve` for
    the longest prefix it answers, then ``getattr`` along the rest. A rest that crosses a
    package the alias builds from table rows (``deepspeed.utils``) is not walked by
    ``getattr`` on deepshard (the alias looks such names up in the table, which ``resolve``
    already asked). Raises ``LookupError`` or ``AttributeError`` when it does not resolve."""
    from deepshard.compat import paths
    from deepshard.compat.alias import resolve

    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if any(paths.is_built(".".join(parts[:k])) for k in range(end + 1, len(parts) + 1)):
            break
        try:
            found = resolve(".".join(parts[:end]))
        except LookupError:
            continue
        for attribute in parts[end:]:
            found = getattr(found, attribute)
        return found
    raise LookupError(f"{name}: neither deepshard's DeepSpeed path table nor deepshard has it")


def audit(target: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The names ``target`` (a ``.py`` file, a directory, or an installed package's name)
    uses with their sites, and those that do not resolve -> why."""
    path = Path(target)
    if path.is_file():
        names = collect_source(path.read_text(encoding="utf-8"), str(path))
    elif path.is_dir():
        names = collect_package(path)
    else:
        found = package_names(target)
        if found is None:
            raise FileNotFoundError(f"{target}: not a file, a directory or an installed package")
        names = found
    missing = {}
    for name in names:
        try:
            resolve_dotted(name)
        except Exception as exc:
            missing[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return names, missing


def main(argv: list[str] | None = None) -> int:
    """``ds_names.py TARGET...``: every DeepSpeed name each target uses, one line each
    (``ok`` or ``MISSING`` with the reason and the first site), then a count; exit 1 when
    any name does not resolve, 2 for a target that is not there."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("targets", nargs="+", help="a .py file, a directory or a package name")
    parser.add_argument("--missing-only", action="store_true")
    args = parser.parse_args(argv)
    status = 0
    for target in args.targets:
        try:
            names, missing = audit(target)
        except FileNotFoundError as exc:
            sys.stderr.write(f"ds_names: error: {exc}\n")
            return 2
        for name, sites in sorted(names.items()):
            if name in missing:
                print(f"{target}: MISSING {name}  ({missing[name]}; {sites[0]})")
            elif not args.missing_only:
                print(f"{target}: ok      {name}")
        print(f"{target}: {len(names)} names, {len(names) - len(missing)} resolve, "
              f"{len(missing)} do not")
        status = status or (1 if missing else 0)
    return status
