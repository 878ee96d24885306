"""Which catalog entries' edited lines a run executes. A mutant whose line never runs on a preset cannot change
anything there: it is absent, neither killed nor a hole in the gates, and its entry claims a preset it does not
test (a refactor moved the path, or the preset takes another branch).

The run is the mutation runner's clean run (the union of the entries' killers, `run_child` with no mutant) on a
probed copy of the package: the first statement of every function holding an edited line hands its frame to
`k3v_line_probe.enter`, which traces that frame's lines (and the comprehensions and lambdas it creates) and
nothing else, so the rest of the run pays no tracing cost. A generator or coroutine runs again after each
yield or await: its frame is traced again each time it resumes, so once one is probed every call in its thread
goes through the (cheap) call filter. Every process of the run records its hits as
`path:line` to a folder (`PROBE_OUT_ENV`): the gloo ranks and the HTTP server's process import the same copy.
"""

from __future__ import annotations

import ast
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from k3verify.gates.mutation.runner import DEFAULT_CATALOG, ChildRun, Mutant, expand_killers, module_file, run_child

PROBE_MODULE = "k3v_line_probe"
PROBE_OUT_ENV = "K3V_LINE_PROBE_OUT"
PROBE_SOURCE = '''"""Line hits of probed functions (written into a probed copy of k3verify by gates/mutation)."""
import os
import sys
import threading

_INNER = ("<listcomp>", "<genexpr>", "<lambda>", "<dictcomp>", "<setcomp>")
_RESUMABLE = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR
_seen = set()
_resumed = set()  # probed generators and coroutines: their frames run again after each yield or await
_state = threading.local()
_lock = threading.Lock()


def _record(frame):
    key = (frame.f_code.co_filename, frame.f_lineno)
    if key in _seen:
        return
    with _lock:
        _seen.add(key)
        with open(os.path.join(os.environ["{env}"], "hits-%d.txt" % os.getpid()), "a") as out:
            out.write("%s:%d\\n" % key)


def _local(frame, event, arg):
    if event == "line":
        _record(frame)
    elif event == "return" and frame.f_code not in _resumed:
        _state.depth -= 1
        if _state.depth == 0 and not _resumed:
            sys.settrace(None)
    return _local


def _inner(frame, event, arg):
    """Lines of comprehensions and lambdas made inside a probed frame; other calls are not traced."""
    if event == "line":
        _record(frame)
    return _inner


def _calls(frame, event, arg):
    if frame.f_code in _resumed:  # a probed generator or coroutine resumed: its lines after a yield or await
        return _local
    back = frame.f_back
    if frame.f_code.co_name in _INNER and back is not None and back.f_trace in (_local, _inner):
        return _inner
    return None


def enter():
    frame = sys._getframe(1)
    _record(frame)
    frame.f_trace_lines = True
    frame.f_trace = _local
    if frame.f_code.co_flags & _RESUMABLE:
        _resumed.add(frame.f_code)  # calls stay traced in this thread from here on, to see it resumed
    else:
        _state.depth = getattr(_state, "depth", 0) + 1
    if sys.gettrace() is None:
        sys.settrace(_calls)
'''.replace("{env}", PROBE_OUT_ENV)
PROBE_CALL = f"__import__({PROBE_MODULE!r}).enter()"


@dataclass(frozen=True)
class Span:
    """One edited snippet, lines [first, last] of `path` (relative to the copy's root), and the line ranges whose
    execution shows the edit in play: the snippet itself inside a function; for a module-level constant, the
    functions that read it (none: only module-level code reads it, which every import of the module runs)."""

    path: str
    first: int
    last: int
    watch: tuple[tuple[int, int], ...]
    probes: tuple[int, ...]  # first lines of the functions to probe for it

    @property
    def at_import(self) -> bool:
        return not self.watch


def _functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _innermost(tree: ast.Module, line: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    holding = [f for f in _functions(tree) if f.lineno <= line <= (f.end_lineno or f.lineno)]
    return max(holding, key=lambda f: f.lineno, default=None)


def _readers(tree: ast.Module, line: int) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions that read a name the module-level statement at `line` assigns."""
    stmt = next((n for n in tree.body if n.lineno <= line <= (n.end_lineno or n.lineno)), None)
    if not isinstance(stmt, ast.Assign | ast.AnnAssign):
        return []
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    names = {t.id for t in targets if isinstance(t, ast.Name)}
    return [f for f in _functions(tree)
            if any(isinstance(n, ast.Name) and n.id in names and isinstance(n.ctx, ast.Load) for n in ast.walk(f))]


def _target_function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    body: list[ast.stmt] = tree.body
    found: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef | None = None
    for part in qualname.split("."):
        found = next((n for n in body if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                      and n.name == part), None)
        if found is None:
            return None
        body = found.body
    return found if isinstance(found, ast.FunctionDef | ast.AsyncFunctionDef) else None


def _lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, int]:
    return fn.lineno, fn.end_lineno or fn.lineno


def spans(mutant: Mutant, root: Path) -> list[Span]:
    """Where the entry edits `root`'s copy: each `old` snippet, or a patch's whole target function."""
    path = module_file(root, mutant.module)
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    rel = str(path.relative_to(root))
    if mutant.kind == "patch":
        fn = _target_function(tree, mutant.attr)
        if fn is None:
            raise ValueError(f"mutant {mutant.id!r}: patch target {mutant.target} is not a function of {rel}")
        return [Span(rel, *_lines(fn), (_lines(fn),), (fn.lineno,))]
    out = []
    for old, _new in mutant.edits:
        if text.count(old) != 1:
            raise ValueError(f"mutant {mutant.id!r}: `old` occurs {text.count(old)} times in {rel}: {old[:80]!r}")
        first = text[: text.index(old)].count("\n") + 1
        last = first + old.count("\n")
        fn = _innermost(tree, first)
        if fn is not None:
            out.append(Span(rel, first, last, ((first, last),), (fn.lineno,)))
        else:
            readers = _readers(tree, first)
            out.append(Span(rel, first, last, tuple(_lines(f) for f in readers), tuple(f.lineno for f in readers)))
    return out


def _probe_file(path: Path, function_lines: set[int]) -> None:
    """Insert PROBE_CALL as the first statement (after a docstring) of each function defined at those lines."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    inserts = []
    for fn in _functions(ast.parse(text)):
        if fn.lineno not in function_lines:
            continue
        body = fn.body
        first = body[1] if (len(body) > 1 and isinstance(body[0], ast.Expr)
                            and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)) \
            else body[0]
        if first.lineno == fn.lineno:
            raise ValueError(f"{path}:{fn.lineno}: {fn.name} has its body on the def line; no probe fits there")
        inserts.append((first.lineno, " " * first.col_offset + PROBE_CALL + "\n"))
    for line, stmt in sorted(inserts, reverse=True):
        lines.insert(line - 1, stmt)
    path.write_text("".join(lines), encoding="utf-8")


def probe_copy(root: Path, mutants: Sequence[Mutant]) -> dict[str, list[Span]]:
    """Probe the package copy under `root` for `mutants`; returns each entry's spans in the probed files."""
    by_file: dict[str, set[int]] = {}
    for m in mutants:
        for s in spans(m, root):
            by_file.setdefault(s.path, set()).update(s.probes)
    for rel, function_lines in by_file.items():
        _probe_file(root / rel, function_lines)
    (root / f"{PROBE_MODULE}.py").write_text(PROBE_SOURCE, encoding="utf-8")
    return {m.id: spans(m, root) for m in mutants}


def read_hits(out_dir: Path, root: Path) -> set[tuple[str, int]]:
    """(path relative to root, line) of every line any process of the run executed in a probed function."""
    hits = set()
    for f in out_dir.glob("hits-*.txt"):
        for row in f.read_text(encoding="utf-8").splitlines():
            name, _, line = row.rpartition(":")
            p = Path(name)
            if p.is_relative_to(root):
                hits.add((str(p.relative_to(root)), int(line)))
    return hits


def absent(spans_by_id: dict[str, list[Span]], hits: set[tuple[str, int]]) -> dict[str, str]:
    """Entry id -> why it is absent from the run: none of its edits was in play (see Span)."""
    out = {}
    for mutant_id, entry_spans in spans_by_id.items():
        if any(s.at_import or any((s.path, line) in hits for a, b in s.watch for line in range(a, b + 1))
               for s in entry_spans):
            continue
        out[mutant_id] = "no edited line ran: " + "; ".join(
            f"{s.path}:{s.first}" + ("" if s.watch == ((s.first, s.last),) else
                                     f" (read by the functions at lines {', '.join(str(a) for a, _ in s.watch)})")
            for s in entry_spans)
    return out


def absent_on(mutants: Sequence[Mutant], preset: str, check_ids: Sequence[str], *, cache_dir: Path,
              timeout_s: float = 900.0, seed: int = 0) -> tuple[dict[str, str], ChildRun]:
    """The clean run of the union of `mutants`' killers on `preset` (`check_ids`: every registered id, for their
    globs), probed: entry id -> why it is absent there (see `absent`), and the child run itself."""
    killers: set[str] = set()
    for m in mutants:
        expected, unmatched = expand_killers(m.killers, check_ids)
        if unmatched:
            raise ValueError(f"mutant {m.id!r}: killer pattern(s) {unmatched} match no registered check")
        killers.update(expected)
    probed: dict[str, list[Span]] = {}
    roots: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="k3v-line-probe-") as out:
        def prepare(root: Path) -> dict[str, str]:
            probed.update(probe_copy(root, mutants))
            roots.append(root)
            return {PROBE_OUT_ENV: out}

        child = run_child(None, preset, sorted(killers), catalog_dir=DEFAULT_CATALOG, cache_dir=cache_dir, seed=seed,
                          threads=None, timeout_s=timeout_s, prepare=prepare)
        hits = read_hits(Path(out), roots[0].resolve())
    return absent(probed, hits), child
