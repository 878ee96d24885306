"""The package's modules import one another without a circle, and its layers import downward only.

Every `import` / `from ... import` of every module under k3verify/ is read with the AST: imports inside functions
and under `if TYPE_CHECKING` count (a deferred import still ties the two modules), relative imports are resolved,
and `from pkg import name` names the submodule pkg.name where one exists. The implicit import of a module's parent
packages is not an edge: a package whose __init__ imports its submodules (kernels/__init__.py registering the ops)
is the one circle Python resolves by design.

Layer rules (RULES below, as data; each names what a layer may not import, and why):
- oracle/: nothing it judges (serving/, kernels/, api/) and nothing of the harness or its drivers (gates/,
  bench/, commands/, cli): a reference that saw the implementation could agree with it by construction.
- kernels/: the lowest shipped layer (ops behind one registry): no model (serving/), no HTTP (api/), no
  reference, no harness, no driver.
- serving/: the implementation we ship imports no reference, no harness, no HTTP layer above it, no remote
  endpoint client and no driver.
- api/: the HTTP layer over the engine ships too: no reference, no harness, no driver.
- gates/: the harness judges what the commands ask it to: it never imports a command, the CLI, the bench (a
  client of the gates' comparisons) or the mutation catalog (data the runner loads from a path, so that
  `mutate --catalog DIR` loads any catalog the same way).
- bench/: measures the shipped code and judges its parity with gates/: no command, no CLI, no catalog.
- commands/: one module per subcommand, loaded by the CLI by name: none imports the CLI back.
- cli: the entry point parses and dispatches (it loads commands/ through importlib): it imports none of the
  layers that do the work.
Besides, only the entry point (k3verify/__main__.py) imports the CLI, and only commands/ imports commands/.

Inside gates/, one job per folder, layered core/ <- report/ <- trust/ and core/ <- shared/ <- checks/<concern>/:
- no module imports a check module (one below gates/checks/): the checks package loads them by path, and what a
  check shares with another check, the bench or a command lives in gates/shared/ under a public name;
- core/ (check model, runner) imports none of report/, trust/, mutation/, shared/ (it loads checks/ by path);
- report/ and trust/ (rendering a run, believing a report) import no check, shared helper or mutation runner;
- shared/ (what checks build on) imports no report, trust or mutation code and not the checks package;
- mutation/ (the runner) imports no check, shared helper or trust code.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "k3verify"

HARNESS_AND_DRIVERS = ("k3verify.gates", "k3verify.bench", "k3verify.commands", "k3verify.cli")
# layer (a module or package prefix) -> what no module below it may import
RULES: dict[str, tuple[str, ...]] = {
    "k3verify.oracle": ("k3verify.serving", "k3verify.kernels", "k3verify.api", *HARNESS_AND_DRIVERS),
    "k3verify.kernels": ("k3verify.serving", "k3verify.api", "k3verify.oracle", *HARNESS_AND_DRIVERS),
    "k3verify.serving": ("k3verify.api", "k3verify.oracle", "k3verify.endpoint", *HARNESS_AND_DRIVERS),
    "k3verify.api": ("k3verify.oracle", "k3verify.endpoint", *HARNESS_AND_DRIVERS),
    "k3verify.gates": ("k3verify.bench", "k3verify.commands", "k3verify.cli", "k3verify.mutations"),
    "k3verify.gates.core": ("k3verify.gates.report", "k3verify.gates.trust", "k3verify.gates.mutation",
                            "k3verify.gates.shared"),
    "k3verify.gates.report": ("k3verify.gates.checks", "k3verify.gates.shared", "k3verify.gates.trust",
                              "k3verify.gates.mutation"),
    "k3verify.gates.trust": ("k3verify.gates.checks", "k3verify.gates.shared", "k3verify.gates.mutation"),
    "k3verify.gates.shared": ("k3verify.gates.checks", "k3verify.gates.report", "k3verify.gates.trust",
                              "k3verify.gates.mutation"),
    "k3verify.gates.mutation": ("k3verify.gates.checks", "k3verify.gates.shared", "k3verify.gates.trust"),
    "k3verify.bench": ("k3verify.commands", "k3verify.cli", "k3verify.mutations"),
    "k3verify.commands": ("k3verify.cli",),
    "k3verify.cli": ("k3verify.oracle", "k3verify.kernels", "k3verify.serving", "k3verify.api",
                     "k3verify.gates", "k3verify.bench", "k3verify.endpoint", "k3verify.target"),
}
# module or package -> the only places that may import it
ONLY_FROM: dict[str, tuple[str, ...]] = {
    "k3verify.cli": ("k3verify.__main__",),
    "k3verify.commands": ("k3verify.commands",),
}
# the package whose modules (those below it) no module imports: they are loaded by path, never borrowed from
CHECKS = "k3verify.gates.checks"


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py below `package` (a package is named by its __init__.py)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _known(name: str, modules: Iterable[str]) -> str | None:
    """The longest known module that `name` is or lies in (an attribute path is cut back to its module)."""
    known = set(modules)
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imported_modules(source: str, module: str = "k3verify.probe", *, is_package: bool = False,
                     modules: Iterable[str] | None = None) -> list[str]:
    """Every module an import in `source` (the text of `module`) names, relative imports resolved and
    `from pkg import name` spelled out as pkg.name. With `modules`, each is cut back to the known module it names
    (so `from k3verify.kernels.registry import REGISTRY` is k3verify.kernels.registry), unknown ones dropped."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                if node.level - 1 > len(here) - 1:
                    raise ValueError(f"{module}: relative import beyond the top package (level {node.level})")
                parent = here[:len(here) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            names.extend(base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names)
    if modules is None:
        return names
    known = list(modules)
    return sorted({k for n in names if (k := _known(n, known)) is not None and k != module})


def import_graph(files: Mapping[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (see the module doc for what counts)."""
    return {m: set(imported_modules(p.read_text(encoding="utf-8"), m, is_package=p.name == "__init__.py",
                                    modules=files)) for m, p in files.items()}


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of two or more modules (Tarjan, iterative): the group's modules
    in the order of a closed path through some of them, first module repeated at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(_closed_path(graph, set(group)))
    return groups


def _closed_path(graph: Mapping[str, set[str]], group: set[str]) -> list[str]:
    """A circle inside a strongly connected group, from its first module (breadth-first, so a shortest one)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & group):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child not in came_from:
                    came_from[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def upward_imports(graph: Mapping[str, set[str]]) -> dict[str, list[str]]:
    """module -> the imports RULES, ONLY_FROM or the check-module rule (CHECKS) forbid it."""
    out: dict[str, list[str]] = {}
    for module, targets in graph.items():
        bad = [t for t in sorted(targets)
               if any(_within(module, layer) and any(_within(t, f) for f in forbidden)
                      for layer, forbidden in RULES.items())
               or any(_within(t, guarded) and not any(_within(module, ok) for ok in allowed)
                      for guarded, allowed in ONLY_FROM.items())
               or t.startswith(CHECKS + ".")]
        if bad:
            out[module] = bad
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = module_files()
    assert len(files) > 100, f"expected the package's modules under {PACKAGE}; found {len(files)}"
    return import_graph(files)


def test_no_import_cycle_among_the_package_modules(graph: dict[str, set[str]]) -> None:
    """No module reaches itself through imports (function-level and type-only imports included)."""
    found = cycles(graph)
    assert not found, f"{len(found)} import circle(s): " + "; ".join(" -> ".join(c) for c in found)


def test_every_layer_imports_nothing_above_it(graph: dict[str, set[str]]) -> None:
    """Each module obeys its layer's rule (RULES) and the entry-point rule (ONLY_FROM); an offender is named."""
    for layer in RULES:
        assert any(_within(m, layer) for m in graph), f"rule for {layer}, which has no module"
    offenders = upward_imports(graph)
    assert not offenders, f"imports against the layer rules: {offenders}"


@pytest.mark.parametrize("line", [
    "import k3verify.serving.model",
    "from k3verify.kernels.registry import pick",
    "from k3verify import serving",
    "def f():\n    from k3verify.kernels import kda\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from k3verify.api.app import create_app\n",
])
def test_scanner_catches_each_import_form(line: str) -> None:
    """The scanner itself bites: each spelling of a forbidden import in the oracle is reported."""
    files = module_files()
    graph = {"k3verify.oracle.probe": set(imported_modules(line, "k3verify.oracle.probe", modules=files))}
    assert upward_imports(graph), line


def test_relative_imports_resolve_against_the_module_or_package() -> None:
    """`from . import x` in a module names its sibling; in a package's __init__, its own child; `..` climbs."""
    assert imported_modules("from . import kda\n", "k3verify.kernels.attn") == ["k3verify.kernels.kda"]
    assert imported_modules("from .torch_ref import f\n", "k3verify.kernels.attn", is_package=True) == [
        "k3verify.kernels.attn.torch_ref.f"]
    assert imported_modules("from ..gates import gate\n", "k3verify.oracle.pinning") == ["k3verify.gates.gate"]


def test_scanner_allows_downward_dependencies() -> None:
    """Config, checkpoint and oracle-internal imports in the oracle, gates in the bench: no false alarm."""
    files = module_files()
    oracle = "from k3verify.checkpoint.names import module_specs\nimport torch\nfrom . import conventions\n"
    graph = {"k3verify.oracle.probe": set(imported_modules(oracle, "k3verify.oracle.probe", modules=files)),
             "k3verify.bench.probe": set(imported_modules("from k3verify.gates import compare\n",
                                                          "k3verify.bench.probe", modules=files))}
    assert graph["k3verify.oracle.probe"] == {"k3verify.checkpoint.names", "k3verify.oracle.conventions"}
    assert not upward_imports(graph)


def test_gates_and_commands_reaching_up_are_caught() -> None:
    """What the harness used to import (the CLI for UsageError, the bench for a baseline) fails the rules."""
    files = module_files()
    for module, line in [("k3verify.gates.core.suite", "from k3verify.cli import UsageError\n"),
                         ("k3verify.gates.checks.serving.dtype",
                          "from k3verify.bench.speed_parity import load_baseline\n"),
                         ("k3verify.commands.plan", "from k3verify.cli import Subparsers\n"),
                         ("k3verify.serving.fixtures", "from k3verify.oracle.fixtures import reference_model\n")]:
        graph = {module: set(imported_modules(line, module, modules=files))}
        assert upward_imports(graph), (module, line)


def test_the_cycle_finder_names_the_circle() -> None:
    """A three-module circle beside a clean chain is found, reported as a closed path; the chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize(("module", "line"), [
    ("k3verify.gates.checks.weights.reconcile", "from k3verify.gates.checks.weights.loader import DROPPED\n"),
    ("k3verify.gates.checks.serving.dtype", "from k3verify.gates.checks.serving import packing\n"),
    ("k3verify.gates.checks.spec.decoding", "def f():\n    import k3verify.gates.checks.spec.kernels\n"),
    ("k3verify.bench.spec_parity", "from k3verify.gates.checks.spec.kernels import fused_vs_unfused_trial\n"),
    ("k3verify.gates.shared.explain", "from k3verify.gates.checks.endpoint.tokens import judge\n"),
])
def test_a_check_module_imported_by_another_module_is_caught(module: str, line: str) -> None:
    """Borrowing from a check module (another check, the bench, a shared helper) fails the rules, naming it."""
    graph = {module: set(imported_modules(line, module, modules=module_files()))}
    found = upward_imports(graph)
    assert found and all(t.startswith(CHECKS + ".") for t in found[module]), (module, line, found)


@pytest.mark.parametrize(("module", "line"), [
    ("k3verify.gates.core.evaluate", "from k3verify.gates.report.html import render_html\n"),
    ("k3verify.gates.core.suite", "from k3verify.gates.shared import builders\n"),
    ("k3verify.gates.report.html", "from k3verify.gates.shared.endpoint_oracle import score\n"),
    ("k3verify.gates.report.html", "import k3verify.gates.checks\n"),
    ("k3verify.gates.trust.lookup", "from k3verify.gates.checks import IMPORT_ERRORS\n"),
    ("k3verify.gates.shared.builders", "from k3verify.gates.trust.lookup import lookup_report\n"),
    ("k3verify.gates.mutation.runner", "from k3verify.gates.shared import builders\n"),
])
def test_a_gates_folder_reaching_across_its_layer_is_caught(module: str, line: str) -> None:
    """Each folder rule of gates/ bites on an import it forbids."""
    assert upward_imports({module: set(imported_modules(line, module, modules=module_files()))}), (module, line)


def test_checks_may_build_on_shared_and_core() -> None:
    """A check importing the shared helpers and the check model, and the runner loading the checks package: no
    false alarm."""
    files = module_files()
    check = "from k3verify.gates import Kind\nfrom k3verify.gates.shared import builders\n"
    graph = {"k3verify.gates.checks.serving.probe": set(imported_modules(check, "k3verify.gates.checks.serving.probe",
                                                                       modules=files)),
             "k3verify.gates.core.probe": set(imported_modules("import k3verify.gates.checks\n",
                                                               "k3verify.gates.core.probe", modules=files))}
    assert graph["k3verify.gates.checks.serving.probe"] == {"k3verify.gates", "k3verify.gates.shared.builders"}
    assert not upward_imports(graph)
