"""The HTTP layer sits on top: k3verify.server imports nothing from the gates or the oracle, and
k3verify.serving (model + engine) imports nothing from k3verify.server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "k3verify"
SERVER_FORBIDDEN = ("k3verify.gates", "k3verify.oracle")
SERVING_FORBIDDEN = ("k3verify.server",)


def imported_modules(source: str) -> list[str]:
    """Every module an `import` / `from ... import` statement names, with `from k3verify import gates`
    spelled out as k3verify.gates so a package-level import cannot slip through."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def forbidden_imports(source: str, forbidden: tuple[str, ...]) -> list[str]:
    return [m for m in imported_modules(source) if any(m == f or m.startswith(f + ".") for f in forbidden)]


def offenders(folder: str, forbidden: tuple[str, ...], at_least: int) -> dict[str, list[str]]:
    files = sorted((PACKAGE_DIR / folder).rglob("*.py"))
    assert len(files) >= at_least, f"expected the sources in {PACKAGE_DIR / folder}; found {files}"
    return {str(f.relative_to(PACKAGE_DIR)): bad for f in files if (bad := forbidden_imports(f.read_text(), forbidden))}


def test_server_imports_nothing_from_gates_or_oracle() -> None:
    """Walk k3verify/server/*.py with ast; any import naming k3verify.gates or k3verify.oracle fails."""
    bad = offenders("server", SERVER_FORBIDDEN, at_least=5)
    assert not bad, f"the HTTP layer imports the judge: {bad}"


def test_serving_imports_nothing_from_server() -> None:
    """The model and engine do not depend on the HTTP layer over them."""
    bad = offenders("serving", SERVING_FORBIDDEN, at_least=5)
    assert not bad, f"serving/ imports the HTTP layer: {bad}"


@pytest.mark.parametrize("line", [
    "import k3verify.gates.report",
    "from k3verify.oracle.model import OracleModel",
    "from k3verify import gates",
    "def f():\n    from k3verify.oracle import kda\n",
])
def test_isolation_scanner_catches_each_import_form(line: str) -> None:
    """The scanner itself bites: each spelling of a forbidden import is reported."""
    assert forbidden_imports(line, SERVER_FORBIDDEN)


def test_isolation_scanner_allows_server_dependencies() -> None:
    """serving, tokenizer and config imports are allowed; k3verify.serving is not k3verify.server."""
    allowed = "from k3verify.serving.engine import Engine\nimport k3verify.tokenizer\nfrom k3verify import config\n"
    assert not forbidden_imports(allowed, SERVER_FORBIDDEN)
    assert not forbidden_imports(allowed, SERVING_FORBIDDEN)
