"""tools/size_report.py: the AST measurement and the docs/SIZES.md row parser (not an enforcement: see the doc)."""

from __future__ import annotations

from pathlib import Path

from tools import size_report as sr

SOURCE = "\n".join([
    "@decorator",  # decorators are not part of the function's length
    "def short():",
    *["    x = 1"] * 3,
    "class K:",
    "    def long(self):",
    *["        y = 2"] * 5,
    "        def inner():",
    *["            z = 3"] * 4,
    "        return inner",
])


def test_measure_counts_defs_to_body_end_with_qualified_names() -> None:
    items = sr.measure(SOURCE, "pkg/m.py", max_file=10, max_func=3)
    got = {(i.name, i.lines) for i in items}
    # long: def line + 5 + inner's 5 + return = 12; inner: def + 4 = 5; short: def + 3 = 4
    assert got == {("", len(SOURCE.splitlines())), ("K.long", 12), ("K.long.inner", 5), ("short", 4)}
    assert sr.measure(SOURCE, "pkg/m.py", max_file=100, max_func=12) == []


def test_doc_rows_name_files_and_functions() -> None:
    doc = ("| file | lines | reason |\n|---|---|---|\n| `pkg/a.py` | 301 | why |\n\n"
           "| file | function | lines | reason |\n|---|---|---|---|\n| `pkg/a.py` | `K.long` | 70 | why |\n"
           "| not a row for a .py file | 1 | x |\n")
    assert sr.documented(doc) == {"pkg/a.py", "pkg/a.py::K.long"}


def test_check_mode_flags_missing_and_stale(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(SOURCE)
    doc = tmp_path / "SIZES.md"
    doc.write_text(f"| `{pkg / 'm.py'}` | `K.long` | 12 | why |\n| `{pkg / 'gone.py'}` | 400 | why |\n")
    args = ["--package", str(pkg), "--max-file", "100", "--max-func", "4", "--check", str(doc)]
    assert sr.main(args) == 1  # K.long.inner (5) is missing, gone.py is stale
    doc.write_text(f"| `{pkg / 'm.py'}` | `K.long` | 12 | why |\n| `{pkg / 'm.py'}` | `K.long.inner` | 5 | why |\n")
    assert sr.main(args) == 0
