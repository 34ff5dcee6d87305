"""Every module that imports megatron.core inside a function has the triton import guard installed
by the time that function runs: its own top-level imports (or its parent packages') reach
``megatron_het.platform``. Without it, the first megatron.core import on a machine without triton
fails (``make demo`` on a fresh clone died in ``data/tokenizer.load_tokenizer`` this way, because the
guard import sat after the megatron import inside the function).

Read from the source with ``ast``; only module-level imports count, as only they have run when
a function is called.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import package_modules

PACKAGE = "megatron_het"
GUARD = "megatron_het.platform"


def _modules() -> dict[str, Path]:
    return package_modules(PACKAGE)


def _top_level_targets(mod: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules imported at module level (with the packages whose __init__ runs on the way)."""
    out: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = mod.split(".") if is_package else mod.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
                prefix = ".".join(parts[:i])
                if prefix.startswith(PACKAGE) and prefix in modules and prefix != mod:
                    out.add(prefix)
    return out


def _lazy_megatron_import(path: Path) -> int | None:
    """Line of the first megatron.core import inside a function, or None."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("megatron.core"):
                    return inner.lineno
                if isinstance(inner, ast.Import) and any(a.name.startswith("megatron.core") for a in inner.names):
                    return inner.lineno
    return None


def _reaches_guard(start: str, modules: dict[str, Path]) -> bool:
    parts = start.split(".")
    todo = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]  # its packages run first
    seen: set[str] = set()
    while todo:
        mod = todo.pop()
        if mod == GUARD:
            return True
        if mod in seen or mod not in modules:
            continue
        seen.add(mod)
        todo.extend(_top_level_targets(mod, modules[mod], modules))
    return False


def test_lazy_megatron_imports_run_after_the_triton_guard():
    modules = _modules()
    lazy = {mod: line for mod, path in modules.items() if (line := _lazy_megatron_import(path)) is not None}
    assert len(lazy) >= 5, f"the scan found only {sorted(lazy)}: is it reading the package?"
    missing = [f"{mod} (line {line})" for mod, line in sorted(lazy.items()) if not _reaches_guard(mod, modules)]
    assert not missing, (
        "these modules import megatron.core inside a function without the triton guard installed at "
        "module level; add `import megatron_het.platform  # noqa: F401` to their top-level imports: "
        + ", ".join(missing))


def test_the_scan_sees_a_module_without_the_guard(tmp_path):
    """The reachability check can fail: a module importing nothing from the project does not reach it."""
    modules = _modules()
    assert not _reaches_guard("megatron_het.errors", modules)
    assert _reaches_guard("megatron_het.model.gpt", modules)
