"""Mutation runner: prove every gate bites by running the parity checks against deliberately broken code.

A mutant is one modelled fault (see k3verify/mutations/README.md). Each runs in a fresh process that imports a
temporary copy of the package: "replace" mutants edit that copy's source (the `old` snippet must occur
exactly once, so a refactor makes the mutant visibly stale), "patch" mutants swap one attribute in the
child before anything else is imported. The child runs `parity --only <expected killers>`; a mutant is
killed iff at least one expected killer went red, and an expected killer that is missing or skipped
makes the mutant an error, never a kill.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import k3verify
from k3verify.gates.report.json_report import load_report

PACKAGE_DIR = Path(k3verify.__file__).resolve().parent
DEFAULT_CATALOG = PACKAGE_DIR / "mutations"  # shipped as part of the package
MUTABLE_PREFIXES = ("k3verify.serving", "k3verify.api", "k3verify.kernels", "k3verify.tokenizer",
                    "k3verify.checkpoint", "k3verify.config", "k3verify.config_json")
RED = ("fail", "vacuous", "error")
# parity's exit codes for a run that produced a report: pass, fail, inconclusive (a mutant child runs only the
# expected killers, which may hold no evidence check: its statuses are what count, not its verdict)
PARITY_INCONCLUSIVE = 4
PARITY_RAN = (0, 1, PARITY_INCONCLUSIVE)
CHILD_MARK = "k3verify-mutant-child: k3verify imported from "


class CatalogError(ValueError):
    """A malformed catalog entry (bad kind, forbidden target, duplicate id)."""


@dataclass(frozen=True)
class Mutant:
    """One modelled fault. `target` is "module:qualname"; `killers` are check-id globs. The catalog writes its
    sequences as lists; they are stored as tuples (a Mutant is frozen and hashable)."""

    id: str
    fault: str
    target: str
    killers: Sequence[str]
    kind: str = "replace"
    old: str | None = None
    new: str | None = None
    patch: Callable[[Any], Any] | None = None
    presets: Sequence[str] = ("k3-tiny",)
    devices: Sequence[str] = ("cpu", "cuda")  # ("cuda",): the fault lives in a CUDA-only fast path
    quick: bool = False
    equivalent: str | None = None
    also: Sequence[tuple[str, str]] = ()  # further (old, new) edits in the same file, for multi-site faults

    def __post_init__(self) -> None:
        object.__setattr__(self, "killers", tuple(self.killers))
        object.__setattr__(self, "presets", tuple(self.presets))
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "also", tuple((str(a), str(b)) for a, b in self.also))
        module = self.module
        if not any(module == p or module.startswith(p + ".") for p in MUTABLE_PREFIXES):
            raise CatalogError(f"mutant {self.id!r}: target module {module!r} is not mutable "
                               f"(allowed: {', '.join(MUTABLE_PREFIXES)}; never the oracle or the gates)")
        if self.kind == "replace" and (self.old is None or self.new is None or self.old == self.new
                                       or any(a == b for a, b in self.also)):
            raise CatalogError(f"replace mutant {self.id!r} needs distinct `old` and `new` snippets")
        if self.kind == "patch" and self.patch is None:
            raise CatalogError(f"patch mutant {self.id!r} needs a `patch` factory (original -> replacement)")
        if self.kind not in ("replace", "patch"):
            raise CatalogError(f"mutant {self.id!r}: kind must be 'replace' or 'patch'; got {self.kind!r}")
        if not self.killers or not self.presets or not self.fault.strip():
            raise CatalogError(f"mutant {self.id!r} needs a fault sentence, >=1 killer and >=1 preset")

    @property
    def edits(self) -> list[tuple[str, str]]:
        return [(self.old or "", self.new or ""), *self.also] if self.kind == "replace" else []

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def attr(self) -> str:
        return self.target.split(":", 1)[1] if ":" in self.target else ""


@dataclass
class Outcome:
    """One (mutant, preset) row of the kill matrix, as written to report.json["mutations"]."""

    mutant: Mutant
    preset: str
    status: str
    killers: list[str] = field(default_factory=list)
    expected_killers: list[str] = field(default_factory=list)
    reason: str | None = None
    duration_s: float = 0.0

    def record(self) -> dict[str, Any]:
        m = self.mutant
        return {"id": m.id, "target": m.target, "fault": m.fault, "status": self.status,
                "killers": sorted(self.killers), "expected_killers": sorted(self.expected_killers),
                "reason": self.reason, "duration_s": round(self.duration_s, 3), "preset": self.preset,
                "kind": m.kind, "quick": m.quick}


def load_catalog(catalog_dir: Path = DEFAULT_CATALOG) -> list[Mutant]:
    """Every `MUTANTS` list of the *.py files in catalog_dir (files starting with "_" are helpers)."""
    if not catalog_dir.is_dir():
        raise CatalogError(f"mutation catalog folder {str(catalog_dir)!r} does not exist "
                           "(point `k3verify mutate --catalog DIR` at a folder of catalog files)")
    mutants: dict[str, Mutant] = {}
    for path in sorted(catalog_dir.glob("*.py")):
        if path.name.startswith("_"):
            continue
        spec = importlib.util.spec_from_file_location(f"k3verify_mutations_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for mutant in getattr(module, "MUTANTS", []):
            if mutant.id in mutants:
                raise CatalogError(f"duplicate mutant id {mutant.id!r} (again in {path.name})")
            mutants[mutant.id] = mutant
    return list(mutants.values())


def select(mutants: Iterable[Mutant], *, only: Sequence[str] = (), suite: str = "full",
           preset: str | None = None, device: str = "cpu") -> list[tuple[Mutant, str]]:
    """(mutant, preset) pairs chosen by id globs, the quick flag, a preset filter and the device kind."""
    pairs: list[tuple[Mutant, str]] = []
    for m in mutants:
        if only and not any(fnmatch.fnmatchcase(m.id, p) for p in only):
            continue
        if (suite == "quick" and not m.quick) or device not in m.devices:
            continue
        pairs.extend((m, p) for p in m.presets if preset is None or p == preset)
    return pairs


def module_file(root: Path, module: str) -> Path:
    """The source file of `module` inside a copy rooted at `root` (the folder holding k3verify/)."""
    base = root.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def stale_reason(mutant: Mutant, root: Path = PACKAGE_DIR.parent) -> str | None:
    """Why the mutant cannot be applied to the code as it is now (None when it can)."""
    path = module_file(root, mutant.module)
    if not path.is_file():
        return f"target module {mutant.module} has no source file ({path.relative_to(root)} missing)"
    if mutant.kind == "patch":
        try:
            owner: Any = importlib.import_module(mutant.module)
            for part in mutant.attr.split("."):
                owner = getattr(owner, part)
        except (ImportError, AttributeError) as exc:
            return f"stale patch mutant: target {mutant.target} does not resolve ({exc})"
    text = path.read_text(encoding="utf-8")
    for old, new in mutant.edits:
        count = text.count(old)
        if count != 1:
            return (f"stale mutant: `old` snippet occurs {count} times in {path.relative_to(root)} (expected "
                    f"exactly once): {old[:80]!r}")
        text = text.replace(old, new)
    try:
        compile(text, str(path), "exec")
    except SyntaxError as exc:
        return f"mutated {path.relative_to(root)} does not compile: {exc}"
    return None


def make_copy(dest_root: Path, mutant: Mutant | None) -> Path:
    """Copy the package into dest_root/k3verify and apply a replace mutant there."""
    shutil.copytree(PACKAGE_DIR, dest_root / "k3verify", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if mutant is not None and mutant.kind == "replace":
        path = module_file(dest_root, mutant.module)
        text = path.read_text(encoding="utf-8")
        for old, new in mutant.edits:
            text = text.replace(old, new, 1)
        path.write_text(text, encoding="utf-8")
    return dest_root


def apply_patch(mutant: Mutant) -> None:
    """Replace `target` (module:Qual.name) by mutant.patch(original) in this process."""
    module = importlib.import_module(mutant.module)
    *owners, name = mutant.attr.split(".")
    owner: Any = module
    for part in owners:
        owner = getattr(owner, part)
    if mutant.patch is None:  # Mutant.__post_init__ refuses this for kind "patch"; a replace mutant has no patch
        raise CatalogError(f"mutant {mutant.id!r} ({mutant.kind}) has no `patch` factory to apply")
    setattr(owner, name, mutant.patch(getattr(owner, name)))


def child_main(cli_main: Callable[[list[str]], int], argv: Sequence[str] | None = None) -> int:
    """Entry point of a mutant process: `--root R [--catalog C --mutant ID] -- <cli args>`, run by `cli_main`
    (the CLI's main, which the child's launch line imports: the harness does not import the CLI that drives it)."""
    args = list(sys.argv[1:] if argv is None else argv)
    split = args.index("--")
    opts = dict(zip(args[:split:2], args[1:split:2], strict=True))
    here = Path(k3verify.__file__).resolve()
    print(CHILD_MARK + str(here), flush=True)
    if not here.is_relative_to(Path(opts["--root"]).resolve()):
        print(f"k3verify mutate: child imported {here}, not the copy under {opts['--root']}", file=sys.stderr)
        return 3
    if "--mutant" in opts:
        by_id = {m.id: m for m in load_catalog(Path(opts["--catalog"]))}
        apply_patch(by_id[opts["--mutant"]])

    return cli_main(args[split + 1:])


@dataclass
class ChildRun:
    returncode: int
    report: dict[str, Any] | None
    imported_from: str | None
    output: str
    duration_s: float


def run_child(mutant: Mutant | None, preset: str, check_ids: Sequence[str], *, catalog_dir: Path, cache_dir: Path,
              seed: int, threads: int | None, timeout_s: float, device: str = "cpu",
              prepare: Callable[[Path], dict[str, str]] | None = None) -> ChildRun:
    """Run `parity --only check_ids` on `preset` in a fresh process against a (mutated) package copy.

    `cache_dir` (K3V_CACHE_DIR) is private to one mutate run: the clean run builds each synthetic checkpoint
    there once; a mutant of checkpoint-writing code changes the cache key and builds its own. `prepare(root)`
    may change the copy before the child starts (gates/mutation/line_probe.py) and returns environment it adds."""

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="k3v-mutant-") as tmp:
        root = make_copy(Path(tmp) / "src", mutant)
        extra_env = prepare(root) if prepare is not None else {}
        report_dir = Path(tmp) / "report"
        cli = ["parity", "--preset", preset, "--suite", "full", "--seed", str(seed), "--device", device,
               "--report-dir", str(report_dir)]
        for check_id in check_ids:
            cli += ["--only", check_id]
        if any(c.startswith("endpoint.") for c in check_ids):
            # Endpoint checks judge a server: the (mutated) package's own, in fp32 where the bars are tightest.
            cli += ["--endpoint", "self", "--dtype", "float32"]
        opts = ["--root", str(root)]
        if mutant is not None and mutant.kind == "patch":
            opts += ["--catalog", str(catalog_dir.resolve()), "--mutant", mutant.id]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
                   PYTHONDONTWRITEBYTECODE="1", K3V_CACHE_DIR=str(cache_dir), **extra_env)
        if threads:
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        code = ("from k3verify.cli import main; from k3verify.gates.mutation.runner import child_main; "
                "raise SystemExit(child_main(main))")
        try:
            # cwd=root: `-c` puts the cwd first on sys.path, ahead of the editable install's finder.
            done = subprocess.run([sys.executable, "-c", code, *opts, "--", *cli], cwd=root, env=env,
                                  capture_output=True, text=True, timeout=timeout_s)
            rc, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, output = -9, f"timed out after {timeout_s:.0f} s\n{_text(exc.stdout)}{_text(exc.stderr)}"
        report = None
        if (report_dir / "report.json").is_file():
            try:
                report = load_report(report_dir)
            except (ValueError, OSError) as exc:
                output += f"\nreport.json unreadable: {exc}"
    imported = next((line[len(CHILD_MARK):] for line in output.splitlines() if line.startswith(CHILD_MARK)), None)
    return ChildRun(rc, report, imported, output, time.perf_counter() - start)


def expand_killers(patterns: Sequence[str], check_ids: Iterable[str]) -> tuple[list[str], list[str]]:
    """(concrete ids matched by the globs, patterns that match no registered check)."""
    ids = sorted(set(check_ids))
    matched: set[str] = set()
    unmatched = []
    for pattern in patterns:
        hits = [c for c in ids if fnmatch.fnmatchcase(c, pattern)]
        if not hits:
            unmatched.append(pattern)
        matched.update(hits)
    return sorted(matched), unmatched


def classify(mutant: Mutant, preset: str, expected: Sequence[str], child: ChildRun) -> Outcome:
    """Turn a child's report into killed / survived / error (see the module docstring)."""
    out = Outcome(mutant, preset, "error", expected_killers=list(expected), duration_s=child.duration_s)
    tail = "\n".join(child.output.strip().splitlines()[-6:])
    if child.imported_from is None or child.returncode == 3:
        out.reason = f"child did not import the mutated copy (rc {child.returncode}): {tail}"
        return out
    if child.report is None or child.returncode not in PARITY_RAN:
        out.reason = f"parity exited {child.returncode} without a usable report: {tail}"
        return out
    by_id = {r["id"]: r for r in child.report["results"]}
    out.killers = [r["id"] for r in child.report["results"] if r["status"] in RED]
    missing = [c for c in expected if c not in by_id]
    skipped = [f"{c} ({by_id[c]['reason']})" for c in expected if c in by_id and by_id[c]["status"] == "skipped"]
    if missing or skipped:
        out.reason = (f"expected killers not executed: missing {missing}, skipped {skipped}; red: "
                      f"{out.killers or 'none'}")
        return out
    hits = sorted(set(out.killers) & set(expected))
    out.status = "killed" if hits else "survived"
    out.reason = f"red: {', '.join(hits)}" if hits else f"every expected killer stayed green: {', '.join(expected)}"
    return out


def _text(captured: str | bytes | None) -> str:
    """What a timed-out child printed (subprocess hands back bytes there even with text=True)."""
    if captured is None:
        return ""
    return captured.decode(errors="replace") if isinstance(captured, bytes) else captured


def red_summary(report: dict[str, Any]) -> list[str]:
    return [f"{r['id']}: {r['status']} ({r['reason']})" for r in report["results"] if r["status"] in RED]
