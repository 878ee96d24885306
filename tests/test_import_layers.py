"""The package's layers import downward only: the oracle never sees what it judges, and the shipped
implementation (serving/, kernels/, server/) never reaches into the harness (gates/) or the oracle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "k3verify"

# package folder -> what no file below it may import
RULES: dict[str, tuple[str, ...]] = {
    "oracle": ("k3verify.serving", "k3verify.kernels", "k3verify.server", "k3verify.gates"),
    "serving": ("k3verify.gates", "k3verify.oracle", "k3verify.server", "k3verify.commands", "k3verify.cli"),
    "kernels": ("k3verify.gates", "k3verify.oracle", "k3verify.serving", "k3verify.server", "k3verify.commands",
                "k3verify.cli"),
    "server": ("k3verify.gates", "k3verify.oracle", "k3verify.commands", "k3verify.cli"),
}


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


def forbidden_imports(source: str, forbidden: tuple[str, ...]) -> list[str]:
    return [m for m in imported_modules(source) if any(m == f or m.startswith(f + ".") for f in forbidden)]


@pytest.mark.parametrize("layer", sorted(RULES))
def test_layer_imports_nothing_above_it(layer: str) -> None:
    """Walk every .py below k3verify/<layer>/ with ast; an import of a forbidden package fails, naming it."""
    root = PACKAGE / layer
    files = sorted(root.rglob("*.py"))
    assert len(files) >= 2, f"expected sources under {root}; found {files}"
    offenders = {str(f.relative_to(PACKAGE)): bad
                 for f in files if (bad := forbidden_imports(f.read_text(), RULES[layer]))}
    assert not offenders, f"{layer}/ imports from a layer above it: {offenders}"


@pytest.mark.parametrize("line", [
    "import k3verify.serving.model",
    "from k3verify.kernels.registry import pick",
    "from k3verify import serving",
    "def f():\n    from k3verify.kernels import kda\n",
])
def test_scanner_catches_each_import_form(line: str) -> None:
    """The scanner itself bites: each spelling of a forbidden import is reported."""
    assert forbidden_imports(line, RULES["oracle"])


def test_scanner_allows_downward_dependencies() -> None:
    """Config, checkpoint and oracle-internal imports are allowed in the oracle (no false alarms)."""
    assert not forbidden_imports("from k3verify.checkpoint.names import module_specs\nimport torch\n", RULES["oracle"])


def test_gates_fixtures_would_be_caught_inside_serving() -> None:
    """The rule that moved the harness out of serving/ bites on what serving/fixtures.py used to import."""
    assert forbidden_imports("from k3verify.oracle.fixtures import reference_model\n", RULES["serving"])
    assert forbidden_imports("from k3verify.gates.report import validate_report\n", RULES["serving"])
