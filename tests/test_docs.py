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


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`+[^`\n]*`+")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but ``-`` and ``_``
    removed, spaces as ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """Every heading anchor of a markdown file (repeats get ``-1``, ``-2``, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, target) of every markdown link outside fenced blocks and code spans."""
    out, fenced = [], False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.extend((i, m.group(1)) for m in LINK.finditer(CODE_SPAN.sub("", line)))
    return out


def broken_links(path: pathlib.Path) -> list[str]:
    """Relative links of ``path`` that point at no file or folder, or at no heading of a
    markdown file (GitHub's anchors)."""
    bad = []
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{path.name}:{line}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.name}:{line}: {target} (no heading #{anchor} in {dest.name})")
    return bad


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    bad = broken_links(path)
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_link_check_sees_broken_links(tmp_path):
    (tmp_path / "other.md").write_text("# A heading: `with` code\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-heading-with-code) [ok](other.md#twice-1) [ok](#local) [web](https://x.org/y)\n"
        "# Local\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere) `[in code](missing.md)`\n"
        "```text\n[in a block](missing.md)\n```\n"
    )
    assert broken_links(page) == [
        "page.md:3: missing.md (no such file)",
        "page.md:3: other.md#nowhere (no heading #nowhere in other.md)",
    ]


def test_slugs_are_githubs():
    assert slug("8. Context parallelism: every rank agrees, or every rank raises") == (
        "8-context-parallelism-every-rank-agrees-or-every-rank-raises"
    )
    assert slug("Made ahead: `doc_packed.cp.prepare`") == "made-ahead-doc_packedcpprepare"
    assert slug("Model vs measured (2x H200)") == "model-vs-measured-2x-h200"
    assert slug("Packing for context parallelism: time") == "packing-for-context-parallelism-time"
