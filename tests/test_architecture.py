"""The house rules docs/architecture.md states, checked on the source.

- Imports run down: ``doc_packed`` <- ``shardings`` <- ``doc_packed_examples`` (the example
  model and the demo) <- ``doc_packed_testing`` (what tests and benchmarks share); nothing
  imports a package above it (not at import time, not lazily in a function). Each library
  imports alone in a fresh interpreter, in either order.
- ``bench`` is a package run as ``python -m bench.<script>``: it imports the packages and its
  own modules by their package names, never a module of ``tests/``, and no module of it or of
  ``doc_packed_testing`` edits ``sys.path``.
- ``doc_packed.data`` (data preparation) sits below the op: it imports only the argument
  checks, the mask's pair counts and the planner's shard ranges and tolerance.
- Private names of torch, AutoParallel and FlashAttention are touched only in the compat
  modules: no ``from torch._x import``/``import torch._x``, no ``from m import _name`` and no
  ``obj._attr`` on anything but ``self``/``cls`` elsewhere in the three packages.
- The page itself matches the code: every file, module and name it puts in backticks exists,
  and its module tables have one row per module of each package.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("doc_packed", "shardings", "doc_packed_examples", "doc_packed_testing")  # bottom up
COMPAT = {
    "doc_packed/_compat.py",
    "shardings/_compat.py",
    "shardings/_ap_compat.py",
    "doc_packed_testing/ap_compat.py",  # test/bench-only shims for AutoParallel's head
}
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
    assert not found, "imports that run up (doc_packed <- shardings <- doc_packed_examples <- doc_packed_testing):\n" + (
        "\n".join(found)
    )


def _edits_sys_path(tree: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "path" and ast.unparse(n.value) == "sys" for n in ast.walk(tree))


def test_bench_imports_packages_not_tests():
    """bench imports its siblings as ``bench.<module>`` and test helpers from
    ``doc_packed_testing``: never a module of tests/ by bare name, never through ``sys.path``."""
    test_modules = {p.stem for p in (ROOT / "tests").glob("*.py")}
    bench_modules = {p.stem for p in (ROOT / "bench").glob("*.py")} - {"__init__"}
    found = []
    for p in sorted((ROOT / "bench").glob("*.py")) + _sources("doc_packed_testing"):
        tree = ast.parse(p.read_text())
        if _edits_sys_path(tree):
            found.append(f"{_rel(p)} edits sys.path")
        for line, module, _ in _imports(tree, _package(p)):
            top = module.split(".")[0]
            if top in test_modules or top == "tests" or top in bench_modules:
                found.append(f"{_rel(p)}:{line} imports {module} by a bare name")
            if p.parent.name == "doc_packed_testing" and top == "bench":
                found.append(f"{_rel(p)}:{line} imports {module}: doc_packed_testing sits below bench")
    assert not found, "bench/doc_packed_testing import rules:\n" + "\n".join(found)


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
            if _is_super(node.value):  # the class's own base: its private names are ours
                continue
            found.append(f"{_rel(path)}:{node.lineno} reads {ast.unparse(node)}")
    return found


def _is_super(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


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
        "w = super()._fine_too()\n"
        "from torch.distributed.tensor import DTensor\n"
    )
    uses = _private_uses(src, "doc_packed")
    assert len(uses) == 6, uses


# -- docs/architecture.md names what the code has ------------------------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _defined(path: pathlib.Path) -> set[str]:
    """Names a module defines at its top level (also under ``if``/``try``), and, for a package's
    ``__init__.py``, its submodules."""
    names: set[str] = set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo.extend(getattr(node, "body", []) + getattr(node, "orelse", []) + getattr(node, "finalbody", []))
            todo.extend(b for h in getattr(node, "handlers", []) for b in h.body)
    if path.name == "__init__.py":
        names.update(p.stem for p in path.parent.iterdir() if p.suffix == ".py" or p.is_dir())
    return names


def _module(parts: list[str]) -> pathlib.Path | None:
    """The file of a dotted module name, as the page writes it: absolute (``doc_packed.cp``) or
    relative to a package (``cp.plan``, ``kernels.spec``, ``strategies``)."""
    for base in (ROOT, *(ROOT / p for p in PACKAGES)):
        stem = base.joinpath(*parts)
        for candidate in (stem.with_suffix(".py"), stem / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _path_exists(text: str) -> bool:
    """A path the page names: from the repository root, from a package, or a file name found in
    a package (``cute.py`` of ``compat/``)."""
    bases = (ROOT, *(ROOT / p for p in PACKAGES), ROOT / "tests", ROOT / "bench")
    if any((b / text).exists() for b in bases):
        return True
    return "/" not in text.rstrip("/") and any(any((ROOT / p).rglob(text.rstrip("/"))) for p in PACKAGES)


def architecture_name_errors(text: str) -> list[str]:
    """Backticked paths, ``path::name`` references and dotted names of our packages that do not
    exist in the code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # code blocks are not names
    bad = []
    for span in CODE_SPAN.findall(text):
        token = re.split(r"[\s(=\[,]", span.strip())[0]
        if "::" in token:
            file, name = token.split("::", 1)
            if not file.endswith(".py"):  # an op name (doc_packed::attn_fwd)
                continue
            found = next((b / file for b in (ROOT, *(ROOT / p for p in PACKAGES)) if (b / file).is_file()), None)
            if found is None:
                bad.append(f"`{span}`: no file {file}")
            elif name.split(".")[0] not in _defined(found):
                bad.append(f"`{span}`: {file} defines no {name}")
        elif re.fullmatch(r"[\w./-]+\.(py|json)|[\w/]+/", token):
            if not _path_exists(token):
                bad.append(f"`{span}`: no such path")
        elif re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", token):
            parts = token.split(".")
            for i in range(len(parts) - 1, 0, -1):
                module = _module(parts[:i])
                if module is not None:
                    if parts[i] not in _defined(module):
                        bad.append(f"`{span}`: {module.relative_to(ROOT)} defines no {parts[i]}")
                    break
    return bad


def test_architecture_page_names_exist():
    """Every file, module and name docs/architecture.md puts in backticks exists (dotted names
    are checked where their first part is one of our modules; others, e.g. torch's, are not)."""
    bad = architecture_name_errors(ARCHITECTURE.read_text())
    assert not bad, "docs/architecture.md names what the code does not have:\n" + "\n".join(bad)


def _module_tables(text: str) -> dict[str, list[tuple[str, str]]]:
    """Per package section (``## doc_packed/``), the (first cell, whole row) of its module table."""
    tables: dict[str, list[tuple[str, str]]] = {}
    section = None
    for line in text.splitlines():
        heading = re.match(r"^## (\w+)/\s*$", line)
        if heading:
            section = heading.group(1)
            tables[section] = []
        elif line.startswith("## "):
            section = None
        elif section and line.startswith("| `"):
            tables[section].append((CODE_SPAN.match(line[2:]).group(1), line))
    return tables


def test_architecture_module_tables_match_the_packages():
    """Each package's table on docs/architecture.md has one row per module and subpackage, no row
    for something that is gone, and a subpackage's row names each of its modules."""
    tables = _module_tables(ARCHITECTURE.read_text())
    assert set(tables) == set(PACKAGES), f"package sections on the page: {sorted(tables)}"
    problems = []
    for package, rows in tables.items():
        root = ROOT / package
        present = {
            p.name + ("/" if p.is_dir() else "")
            for p in root.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())
        }
        listed = {name for name, _ in rows if name != "__init__.py"}
        problems += [f"{package}/{n}: no row" for n in sorted(present - listed)]
        problems += [f"{package}/{n}: row for a module that does not exist" for n in sorted(listed - present)]
        for name, row in rows:
            if name.endswith("/") and (root / name).is_dir():
                for module in sorted((root / name).glob("*.py")):
                    if module.name != "__init__.py" and module.stem not in row:
                        problems.append(f"{package}/{name}{module.name}: not named in its package's row")
    assert not problems, "docs/architecture.md's module tables against the code:\n" + "\n".join(problems)


def test_the_name_check_sees_wrong_names():
    """The check itself catches each form (a check that finds nothing proves nothing)."""
    page = (
        "`ops._SHARED` `ops._SHARED_ARGS` `kernels/__init__.py::TABLE` `kernels/__init__.py::NOPE` "
        "`cp/plan.py` `cp/nope.py` `doc_packed::attn_fwd` `torch.chunk` `cp.plan.chunk_len(S, c)`\n"
        "```python\nops.not_a_name\n```\n"
    )
    assert architecture_name_errors(page) == [
        "`ops._SHARED_ARGS`: doc_packed/ops.py defines no _SHARED_ARGS",
        "`kernels/__init__.py::NOPE`: kernels/__init__.py defines no NOPE",
        "`cp/nope.py`: no such path",
    ]
