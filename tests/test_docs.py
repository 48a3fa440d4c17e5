"""Every Python code block of README.md and docs/*.md runs, as written.

The blocks of one file run top to bottom in one namespace (a later block may use names an
earlier one defined), on CPU. A block is Python when its fence says ``python``; ``bash``, ``text``
and other fences are not run, and an unlabelled fence must not hold Python (label it). A comment
on the line before a fence changes how its block runs (rare; each says why):

- ``<!-- doc-test: skip (why) -->``: not run (a fragment of a larger program);
- ``<!-- doc-test: autoparallel -->``: needs AutoParallel (skipped, with the import's error, without it);
- ``<!-- doc-test: requires MODULE ... -->`` on a file's first Python block: the file runs only where
  those optional packages import (skipped, naming them, elsewhere: docs/models.md needs the
  ``hf`` and ``torchtitan`` extras, which CI installs);
- ``<!-- doc-test: ranks N -->`` on a file's first Python block: the file runs on N gloo ranks
  (spawned processes, ``torch.distributed`` already initialised, as ``torchrun`` would leave it).

New markdown files are picked up by the glob; nothing here lists them.
"""

from __future__ import annotations

import ast
import pathlib
import re
import runpy
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)\s*$")
MARK = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->\s*$")
# files whose Python takes more than ~10 s on 2 cores (AutoParallel planning, gloo ranks)
SLOW = {"getting_started.md"}


def blocks(path: pathlib.Path) -> list[tuple[int, str, str, str]]:
    """(line of the fence, language, marker or "", code) of every fenced block."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(prev.strip())
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i])
            i += 1
        out.append((start + 1, lang, mark.group(1) if mark else "", "\n".join(body) + "\n"))
        i += 1
    return out


def _python_files():
    for path in FILES:
        if any(lang == "python" for _, lang, _, _ in blocks(path)):
            marks = [pytest.mark.slow] if path.name in SLOW else []
            yield pytest.param(path, id=str(path.relative_to(ROOT)), marks=marks)


def _program(path: pathlib.Path, with_autoparallel: bool) -> tuple[str, int]:
    """The file's runnable Python as one program (each block compiled at its own line numbers
    through ``exec``) and the ranks it asks for. Without AutoParallel the program stops before
    the first block that needs it (later blocks may use what it made)."""
    parts, ranks = [], 1
    for line, lang, mark, code in blocks(path):
        if lang != "python":
            continue
        if mark.startswith("skip"):
            continue
        if mark.startswith("ranks"):
            ranks = int(mark.split()[1])
        elif mark == "autoparallel" and not with_autoparallel:
            break
        name = f"{path.relative_to(ROOT)}:{line}"
        parts.append(f"exec(compile({code!r}, {name!r}, 'exec'), globals())\n")
    return "".join(parts), ranks


def run_doc(rank: int, world: int, program: str) -> None:
    """A rank body: run the doc's program as ``__main__`` (module level, so spawn can import it)."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(program)
    runpy.run_path(f.name, run_name="__main__")


@pytest.mark.parametrize("path", list(_python_files()))
def test_python_blocks_run(path, run_ranks):
    import importlib.util

    from doc_packed.env import autoparallel_status

    for _, _, mark, _ in blocks(path):
        if mark.startswith("requires "):
            missing = [m for m in mark.split()[1:] if importlib.util.find_spec(m) is None]
            if missing:
                pytest.skip(f"needs {', '.join(missing)} (optional; pip install 'doc-packed[hf,torchtitan]')")

    ap_ok, why = autoparallel_status()
    needs_ap = any(mark == "autoparallel" for _, _, mark, _ in blocks(path))
    program, ranks = _program(path, ap_ok)
    if ranks == 1:
        run_doc(0, 1, program)
    else:
        run_ranks(run_doc, ranks, program, timeout=900)
    if needs_ap and not ap_ok:
        pytest.skip(f"ran the blocks before the first one that needs AutoParallel; the rest: {why}")


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_unlabelled_blocks_are_not_python(path):
    """An unlabelled fence would hide code from the test above: label it python (or text)."""
    for line, lang, _, code in blocks(path):
        if lang or not code.strip():
            continue
        try:
            ast.parse(code)
        except SyntaxError:
            continue
        raise AssertionError(f"{path.name}:{line}: an unlabelled block parses as Python; label its fence")


def test_markers_are_known():
    for path in FILES:
        for line, lang, mark, _ in blocks(path):
            if mark:
                assert lang == "python", f"{path.name}:{line}: doc-test markers go before python blocks"
                known = r"skip \(.+\)|autoparallel|ranks \d+|requires( [\w.]+)+"
                assert re.fullmatch(known, mark), f"{path.name}:{line}: {mark!r}"
