"""The house rules docs/architecture.md states, checked on the source.

- Imports run down: ``doc_packed`` <- ``shardings`` <- ``doc_packed_examples`` (the example
  model and the demo); nothing imports a package above it (not at import time, not lazily in
  a function). Each library imports alone in a fresh interpreter, in either order.
- ``doc_packed.data`` (data preparation) sits below the op: it imports only the argument
  checks, the mask's pair counts and the planner's shard ranges and tolerance.
- Private names of torch, AutoParallel and FlashAttention are touched only in the compat
  modules: no ``from torch._x import``/``import torch._x``, no ``from m import _name`` and no
  ``obj._attr`` on anything but ``self``/``cls`` elsewhere in the three packages.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("doc_packed", "shardings", "doc_packed_examples")  # bottom up
COMPAT = {"doc_packed/_compat.py", "shardings/_compat.py", "shardings/_ap_compat.py"}
EXTERNAL = ("torch", "autoparallel", "flash_attn")


def _sources(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package(path: pathlib.Path) -> str:
    """The package a source file's relative imports resolve against (``doc_packed.data``)."""
    return ".".join(path.relative_to(ROOT).parts[:-1])


def _imports(tree: ast.AST, package: str) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import in a module of ``package``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolve against the package, one level up per extra dot
                parts = package.split(".")
                module = ".".join(parts[: len(parts) - node.level + 1] + ([module] if module else []))
            out.append((node.lineno, module, [a.name for a in node.names]))
    return out


def test_imports_run_down():
    found = [
        f"{_rel(p)}:{line} imports {module}"
        for level, package in enumerate(PACKAGES)
        for p in _sources(package)
        for line, module, _ in _imports(ast.parse(p.read_text()), _package(p))
        if module.split(".")[0] in PACKAGES[level + 1 :]
    ]
    assert not found, "imports that run up (doc_packed <- shardings <- doc_packed_examples):\n" + "\n".join(found)


# what shardings may use of doc_packed (docs/architecture.md)
SHARDINGS_MAY_IMPORT = {"doc_packed", "doc_packed.ops", "doc_packed.flops", "doc_packed.data", "doc_packed._compat"}


def test_shardings_uses_doc_packed_through_its_stated_surface():
    found = [
        f"{_rel(p)}:{line} imports {module}"
        for p in _sources("shardings")
        for line, module, _ in _imports(ast.parse(p.read_text()), _package(p))
        if module.split(".")[0] == "doc_packed" and module not in SHARDINGS_MAY_IMPORT
    ]
    assert not found, "shardings reaches into doc_packed internals:\n" + "\n".join(found)


# what data preparation may use of the rest of doc_packed (docs/architecture.md): never the op
DATA_MAY_IMPORT = {"doc_packed._checks", "doc_packed._mask", "doc_packed.cp.plan"}


def test_data_preparation_sits_below_the_op():
    found = [
        f"{_rel(p)}:{line} imports {module}"
        for p in _sources("doc_packed/data")
        for line, module, _ in _imports(ast.parse(p.read_text()), _package(p))
        if module.split(".")[0] == "doc_packed"
        and module.split(".")[:2] != ["doc_packed", "data"]
        and module not in DATA_MAY_IMPORT
    ]
    assert not found, "doc_packed.data imports above its layer:\n" + "\n".join(found)


def test_relative_imports_resolve_as_python_resolves_them():
    code = "from .._mask import x\nfrom ._rows import y\nfrom . import z\nfrom .. import ops"
    assert [m for _, m, _ in _imports(ast.parse(code), "doc_packed.data")] == [
        "doc_packed._mask",
        "doc_packed.data._rows",
        "doc_packed.data",
        "doc_packed",
    ]


@pytest.mark.parametrize(
    "order", [("doc_packed",), ("shardings",), ("doc_packed", "shardings"), ("shardings", "doc_packed")]
)
def test_packages_import_alone_in_either_order(order):
    code = (
        "import importlib, sys\n"
        f"for name in {order!r}:\n"
        "    importlib.import_module(name)\n"
        "    if name == 'doc_packed' and 'shardings' not in " + repr(order[:1]) + ":\n"
        "        assert 'shardings' not in sys.modules, 'importing doc_packed imported shardings'\n"
        "import torch\n"
        "from torch.distributed.tensor import DTensor\n"
        "handlers = DTensor._op_dispatcher._custom_op_handlers\n"
        "print(torch.ops.doc_packed.attn_fwd.default in handlers)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str("shardings" in order)  # registered exactly when imported


def _private_uses(path: pathlib.Path, package: str) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for line, module, names in _imports(tree, package):
        parts = module.split(".")
        if parts[0] not in EXTERNAL:
            continue
        bad = [p for p in parts if _private(p)] + [n for n in names if _private(n)]
        if bad:
            found.append(f"{_rel(path)}:{line} imports {module} {names}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append(f"{_rel(path)}:{node.lineno} reads {ast.unparse(node)}")
    return found


def test_private_names_only_in_compat_modules():
    found = [
        use
        for package in PACKAGES
        for p in _sources(package)
        if _rel(p) not in COMPAT
        for use in _private_uses(p, package)
    ]
    assert not found, "private names outside the compat modules:\n" + "\n".join(found)


def test_the_scan_sees_private_uses(tmp_path):
    """The scan itself catches each form (a scan that finds nothing proves nothing)."""
    src = tmp_path / "m.py"
    src.write_text(
        "import torch._dynamo\n"
        "from torch.distributed.tensor._op_schema import OpSpec\n"
        "from torch.nn.attention.flex_attention import _apply_kernel_options\n"
        "from autoparallel.x import _y\n"
        "x = torch.ops._c10d_functional\n"
        "y = obj._private_method()\n"
        "z = self._fine\n"
        "from torch.distributed.tensor import DTensor\n"
    )
    uses = _private_uses(src, "doc_packed")
    assert len(uses) == 6, uses
