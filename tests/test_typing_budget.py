"""`# type: ignore` comments in k3verify/ stay within the counted list in docs/TYPING.md.

Comments are found with `tokenize` (a docstring or string that mentions the phrase is not an ignore).
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "TYPING.md"
IGNORE = re.compile(r"#\s*type:\s*ignore\b")
# `# type: ignore[code, code]  # reason`: an error code and a reason after it
WELL_FORMED = re.compile(r"#\s*type:\s*ignore\[[a-z0-9-]+(,\s*[a-z0-9-]+)*\]\s+#\s*\S")


def ignore_comments(source: str) -> list[tuple[int, str]]:
    """(line, comment text) of every comment holding a `type: ignore`."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [(tok.start[0], tok.line.strip()) for tok in tokens
            if tok.type == tokenize.COMMENT and IGNORE.search(tok.string)]


def package_ignores() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted((ROOT / "k3verify").rglob("*.py")):
        for line, text in ignore_comments(path.read_text(encoding="utf-8")):
            found.append((str(path.relative_to(ROOT)), line, text))
    return found


def budget() -> tuple[int, int]:
    """(the doc's `Budget: N`, the number of rows in its table of allowed ignores)."""
    text = DOC.read_text(encoding="utf-8")
    m = re.search(r"^Budget: (\d+)$", text, re.MULTILINE)
    if m is None:
        raise AssertionError(f"{DOC} has no 'Budget: N' line")
    lines = text[m.end():].splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith("| file |")), None)
    if header is None:
        raise AssertionError(f"{DOC} has no '| file | ...' table after its budget line")
    rows = 0
    for line in lines[header + 2:]:  # skip the header and its |---| separator
        if not line.startswith("|"):
            break
        rows += 1
    return int(m.group(1)), rows


def test_package_ignores_within_budget() -> None:
    allowed, _ = budget()
    found = package_ignores()
    listing = "\n".join(f"  {f}:{n}: {t}" for f, n, t in found)
    assert len(found) <= allowed, (f"{len(found)} `# type: ignore` in k3verify/, docs/TYPING.md allows {allowed}: "
                                   f"fix the types, or list each one there with its reason\n{listing}")


def test_budget_equals_listed_rows() -> None:
    allowed, rows = budget()
    assert rows == allowed, f"docs/TYPING.md: 'Budget: {allowed}' but its table lists {rows} ignore(s)"


def test_every_ignore_has_code_and_reason() -> None:
    bad = [(f, n, t) for f, n, t in package_ignores() if not WELL_FORMED.search(t)]
    assert not bad, f"ignores without `[code]  # reason`: {bad}"


def test_counter_sees_comments_not_strings() -> None:
    source = ('x: int = "a"  # type: ignore[assignment]  # why\n'
              's = "# type: ignore in a string"\n'
              '"""# type: ignore in a docstring"""\n'
              'y = f()  #type:ignore\n')
    found = ignore_comments(source)
    assert [line for line, _ in found] == [1, 4]
    assert [bool(WELL_FORMED.search(t)) for _, t in found] == [True, False]


@pytest.mark.parametrize("ci_line", ["python3 -m ruff check .", "python3 -m mypy k3verify"])
def test_ci_runs_lint_and_types(ci_line: str) -> None:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci_line in lines, f".ci/run does not run `{ci_line}`"
    assert lines.index("python3 -m mypy k3verify") > lines.index("python3 -m ruff check ."), "types run after lint"
