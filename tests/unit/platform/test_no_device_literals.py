"""No device or backend string literal outside ``megatron_het/platform/`` (issue 14).

The accelerator object (``platform/accelerator.py``) owns device, backends, timing and memory, so a
CPU run and a GPU run take the same code path. This walks every string constant of the package's
syntax trees (docstrings and comments are prose, not code, and are skipped) and fails on a device or
torch-backend name.

Principled exception: *catalog data*. Vendors and collective libraries are names a cluster file
uses (``vendor: cpu``, ``collective_library: nccl``). They are never handed to torch; the catalog
(``cluster/catalog.py``) names them once (``NVIDIA``, ``HOST``, ``NCCL``, ...) and every other package
compares against those constants or asks ``DeviceType.is_host``. The runtime reads them through
``RankPlacement`` and asks the accelerator for a backend. ``plan/layout.py``'s default island name and
a profile-format example remain in DATA_PACKAGES.
"""

from __future__ import annotations

import ast

from support.paths import REPO

PACKAGE = REPO / "megatron_het"
FORBIDDEN = {"cpu", "gloo", "nccl", "cuda", "mps", "xpu"}  # torch device types and backends (lower case)
FORBIDDEN_PREFIXES = ("cuda:", "cpu:")
# catalog data: vendor / collective-library names from cluster files, never passed to torch
DATA_PACKAGES = {"cluster", "perf", "plan"}
EXEMPT = {
    "platform",  # the one place that names devices and backends
}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def literal_violations(source: str, filename: str) -> list[str]:
    """``file:line: 'literal'`` for each device/backend string constant in ``source``."""
    tree = ast.parse(source, filename)
    skip = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            v = node.value.strip()  # torch names are lower case; "CPU" is a catalog device type
            if v in FORBIDDEN or v.startswith(FORBIDDEN_PREFIXES):
                out.append(f"{filename}:{node.lineno}: {node.value!r}")
    return out


def test_no_device_or_backend_literals_outside_platform():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        top = rel.parts[0] if len(rel.parts) > 1 else ""
        if top in EXEMPT or top in DATA_PACKAGES:
            continue
        bad += literal_violations(path.read_text(), str(path.relative_to(REPO)))
    assert not bad, ("device/backend literals outside megatron_het/platform/ (ask the Accelerator: "
                     "acc.device, acc.torch_backend, acc.host_backend, platform.HOST_DEVICE):\n" + "\n".join(bad))


def test_the_lint_catches_a_literal():
    """The check itself can fail: a literal device and a literal backend are both reported."""
    src = 'import torch\nx = torch.zeros(3, device="cpu")\ndist.new_group([0], backend="nccl")\n"""cpu in prose"""\n'
    found = literal_violations(src, "example.py")
    assert found == ["example.py:2: 'cpu'", "example.py:3: 'nccl'"]
