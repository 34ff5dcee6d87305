"""The package's import graph: no cycles between modules or packages, no private name across packages.

Read from the source with ``ast`` (nothing is imported), including imports inside functions and
``TYPE_CHECKING`` blocks: an import hidden in a function is still a dependency, and hiding a cycle
there only moves the failure to run time.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from support.paths import REPO, package_modules

PACKAGE = "megatron_het"


def _modules() -> dict[str, Path]:
    return package_modules(PACKAGE)


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module that ``name`` (a module or a name inside one) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(modules: dict[str, Path]) -> list[tuple[str, str, str, int]]:
    """(importer, imported module, imported name or "", line) for every project-internal import."""
    out = []
    for mod, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _owner(alias.name, modules) if alias.name.startswith(PACKAGE) else None
                    if target and target != mod:
                        out.append((mod, target, "", node.lineno))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    parts = mod.split(".") if is_package else mod.split(".")[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                if not base.startswith(PACKAGE):
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    target = full if full in modules else _owner(base, modules)
                    if target and target != mod:
                        out.append((mod, target, "" if full in modules else alias.name, node.lineno))
    return out


def _cycles(nodes, edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
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
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _describe(cycle: list[str], imports, key) -> str:
    members = set(cycle)
    found = sorted({f"    {importer}:{line} imports {target}" for importer, target, _name, line in imports
                    if key(importer) in members and key(target) in members and key(importer) != key(target)})
    return "\n".join([" <-> ".join(cycle), *found])


def test_cycle_finder_sees_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(["a", "b", "c", "d"], edges) == [["a", "b", "c"]]
    assert _cycles(["a", "b"], {"a": {"b"}}) == []


def test_no_import_cycle_between_modules():
    modules = _modules()
    imports = _imports(modules)
    edges = defaultdict(set)
    for importer, target, _name, _line in imports:
        edges[importer].add(target)
    cycles = _cycles(sorted(modules), edges)
    assert not cycles, "module import cycles:\n" + "\n".join(
        _describe(c, imports, lambda m: m) for c in cycles)


def test_no_import_cycle_between_packages():
    modules = _modules()
    imports = _imports(modules)
    edges = defaultdict(set)
    for importer, target, _name, _line in imports:
        if _package(importer) != _package(target):
            edges[_package(importer)].add(_package(target))
    cycles = _cycles(sorted({_package(m) for m in modules}), edges)
    assert not cycles, "package import cycles:\n" + "\n".join(
        _describe(c, imports, _package) for c in cycles)


def test_no_private_name_imported_across_packages():
    offenders = []
    for importer, target, name, line in _imports(_modules()):
        if _package(importer) == _package(target):
            continue
        private = [p for p in (name, target.rpartition(".")[2]) if p.startswith("_") and not p.startswith("__")]
        if private:
            offenders.append(f"{importer}:{line} imports {private[0]} from {target}")
    assert not offenders, "private names imported across packages:\n" + "\n".join(offenders)


def test_no_path_manipulation_in_scripts():
    offenders = [str(p.relative_to(REPO)) for folder in ("tools", "bench", "pretrain_scripts")
                 for p in sorted((REPO / folder).rglob("*.py")) if "sys.path" in p.read_text(encoding="utf-8")]
    assert not offenders, f"sys.path set-up in {offenders}: install the package (pip install -e .) instead"


def _private_definitions(modules: dict[str, Path]) -> dict[str, set[str]]:
    """package -> private names it defines (functions, methods, ``self._x`` attributes)."""
    out = defaultdict(set)
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                out[_package(mod)].add(name)
    return out


def test_no_private_attribute_of_another_package():
    """``trainer._timed`` from resilience/ reaches into runtime/: give it a public name instead."""
    modules = _modules()
    defined = _private_definitions(modules)
    offenders = []
    for mod, path in modules.items():
        here = _package(mod)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            owners = {pkg for pkg, names in defined.items() if node.attr in names}
            if owners and here not in owners:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} uses {ast.unparse(node)} "
                                 f"(defined in {', '.join(sorted(owners))})")
    assert not offenders, "private attributes of another package:\n" + "\n".join(offenders)
