"""The oracle must stay independent of what it judges: no import of serving/, server/ or kernels/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ORACLE_DIR = Path(__file__).resolve().parents[2] / "k3verify" / "oracle"
FORBIDDEN = ("k3verify.serving", "k3verify.server", "k3verify.kernels")


def imported_modules(source: str) -> list[str]:
    """Every module an `import` / `from ... import` statement names, with `from k3verify import serving`
    spelled out as k3verify.serving so a package-level import cannot slip through."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def forbidden_imports(source: str) -> list[str]:
    return [m for m in imported_modules(source) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]


def test_oracle_files_import_nothing_from_serving_or_kernels() -> None:
    """Walk k3verify/oracle/*.py with ast; any import naming k3verify.serving or k3verify.kernels fails."""
    files = sorted(ORACLE_DIR.glob("*.py"))
    assert len(files) >= 5, f"expected the oracle sources in {ORACLE_DIR}; found {files}"
    offenders = {f.name: bad for f in files if (bad := forbidden_imports(f.read_text()))}
    assert not offenders, f"oracle files import the code they judge: {offenders}"


@pytest.mark.parametrize("line", [
    "import k3verify.serving.model",
    "from k3verify.kernels.registry import pick",
    "from k3verify import serving",
    "def f():\n    from k3verify.kernels import kda\n",
])
def test_isolation_scanner_catches_each_import_form(line: str) -> None:
    """The scanner itself bites: each spelling of a forbidden import is reported."""
    assert forbidden_imports(line)


def test_isolation_scanner_allows_oracle_dependencies() -> None:
    """Config, checkpoint and oracle imports are allowed (no false alarms)."""
    assert not forbidden_imports("from k3verify.checkpoint.names import module_specs\nimport torch\n")
