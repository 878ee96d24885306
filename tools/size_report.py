#!/usr/bin/env python3
"""Files over --max-file lines and functions over --max-func lines in a package (STYLE: ~300 / ~60).

    python tools/size_report.py                    # k3verify/, table to stdout
    python tools/size_report.py --check docs/SIZES.md

Function length is measured by the AST: from the `def` line (decorators excluded) to the last line of its
body, so a nested function counts inside its parent and again on its own. --check lists the items over the
limits that DOC does not name (a row naming the file, or the file and `qualname`) and the DOC rows that are
no longer over a limit; it exits 1 when either list is not empty.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Item:
    path: str  # relative to the repository root
    name: str  # "" for a whole file, else the function's qualified name
    lines: int

    @property
    def key(self) -> str:
        return f"{self.path}::{self.name}" if self.name else self.path


def _functions(tree: ast.Module) -> list[tuple[str, int]]:
    """(qualified name, line count) of every function, nested ones included."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                found.append((name, (child.end_lineno or child.lineno) - child.lineno + 1))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def measure(source: str, path: str, max_file: int, max_func: int) -> list[Item]:
    items = []
    n_lines = len(source.splitlines())
    if n_lines > max_file:
        items.append(Item(path, "", n_lines))
    for name, n in _functions(ast.parse(source, filename=path)):
        if n > max_func:
            items.append(Item(path, name, n))
    return items


def scan(package: Path, max_file: int, max_func: int) -> list[Item]:
    items = []
    for path in sorted(package.rglob("*.py")):
        rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        items.extend(measure(path.read_text(encoding="utf-8"), rel, max_file, max_func))
    return items


def documented(doc_text: str) -> set[str]:
    """Keys named by DOC's table rows: `| path | lines | reason |` or `| path | `qualname` | lines | reason |`."""
    keys = set()
    for line in doc_text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or not cells[0].strip("`").endswith(".py"):
            continue
        path = cells[0].strip("`")
        name = cells[1].strip("`") if not re.fullmatch(r"\d+", cells[1]) else ""
        keys.add(f"{path}::{name}" if name else path)
    return keys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--package", type=Path, default=ROOT / "k3verify")
    ap.add_argument("--max-file", type=int, default=300)
    ap.add_argument("--max-func", type=int, default=60)
    ap.add_argument("--check", type=Path, default=None, metavar="DOC")
    args = ap.parse_args(argv)
    items = scan(args.package.resolve(), args.max_file, args.max_func)
    if args.check is None:
        files = sorted((i for i in items if not i.name), key=lambda i: -i.lines)
        funcs = sorted((i for i in items if i.name), key=lambda i: -i.lines)
        print(f"| file | lines |  ({len(files)} files > {args.max_file} lines)\n|---|---|")
        print("\n".join(f"| {i.path} | {i.lines} |" for i in files))
        print(f"\n| file | function | lines |  ({len(funcs)} functions > {args.max_func} lines)\n|---|---|---|")
        print("\n".join(f"| {i.path} | `{i.name}` | {i.lines} |" for i in funcs))
        return 0
    listed = documented(args.check.read_text(encoding="utf-8"))
    missing = sorted(i.key for i in items if i.key not in listed)
    stale = sorted(listed - {i.key for i in items})
    for key in missing:
        print(f"over the limit, not in {args.check}: {key}")
    for key in stale:
        print(f"in {args.check}, no longer over the limit: {key}")
    print(f"{len(items)} over the limits; {len(missing)} undocumented, {len(stale)} stale")
    return 1 if missing or stale else 0


if __name__ == "__main__":
    sys.exit(main())
