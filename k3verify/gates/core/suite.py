"""Select checks and run them: one seeded generator per check, timing, and no check can stop the run.

`run_suite` needs no model: it takes a list of Checks and a factory that builds each CheckContext,
so the engine is testable on its own and `parity` only supplies the factory.
"""

from __future__ import annotations

import fnmatch
import gc
import importlib.metadata
import os
import platform
import re
import subprocess
import time
import traceback
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import k3verify
from k3verify.errors import BadTargetData, UsageError
from k3verify.gates.core.binding import dtypes_of_run, source_digest, verdict_from_counts
from k3verify.gates.core.check import REGISTRY, Check, CheckContext, Result, SkipCheck, Status
from k3verify.gates.core.evaluate import evaluate_trial
from k3verify.gates.core.evidence import SIZE_SKIP, missing_evidence
from k3verify.gates.core.noise import NoiseLookup
from k3verify.gates.core.noise import lookup as noise_lookup
from k3verify.gates.core.resources import PeakMemory

if TYPE_CHECKING:
    from k3verify.endpoint.session import EndpointSession
    from k3verify.target import Target

ContextFactory = Callable[[Check, torch.Generator], CheckContext]
ENV_PREFIX = "K3V_"
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")  # K3V_ variables whose value a report never holds
ENDPOINT_PREFIX = "endpoint."  # checks of `parity --endpoint`, which judge another server and never a gate


@dataclass
class RunInfo:
    """Run metadata as stored in report.json["run"]. `device` is the device kind ("cpu"|"cuda"):
    together with k3verify_version and checkpoint_digest it is what `serve` matches on."""

    k3verify_version: str
    git_sha: str
    git_dirty: bool | None
    python: str
    torch: str | None
    transformers: str | None
    fla: str | None
    device: str
    device_name: str
    preset: str | None
    checkpoint: str | None
    checkpoint_digest: str | None
    seed: int
    suite: str
    only: list[str] = field(default_factory=list)
    started_at: str = ""
    wall_time_s: float = 0.0
    oracle: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    source_digest: str = ""  # gates/core/binding.source_digest of the package that ran
    endpoint: dict[str, Any] | None = None  # `parity --endpoint`: which server answered, its features, the traffic
    dtypes: list[str] = field(default_factory=list)  # serving-model dtypes model/serving-level checks ran in


@dataclass
class RunResult:
    run: RunInfo
    results: list[Result]
    mutations: list[dict[str, Any]] = field(default_factory=list)
    setup_error: str | None = None  # the run never got to its checks (verdict "error")

    @property
    def counts(self) -> dict[str, int]:
        return status_counts(self.results)

    @property
    def missing_evidence(self) -> list[str]:
        """Why the results do not show the model's outputs compared (gates/core/evidence.py); empty when they do."""
        if self.setup_error is not None:
            return []
        return missing_evidence(result_records(self.results))

    @property
    def verdict(self) -> str:
        return verdict_from_counts(self.counts, self.setup_error, self.missing_evidence)


def status_counts(results: Iterable[Result]) -> dict[str, int]:
    counts = {s.value: 0 for s in Status}
    for r in results:
        counts[Status(r.status).value] += 1
    return counts


def verdict(results: Sequence[Result]) -> str:
    """"pass" iff nothing failed, was vacuous or errored (skips are fine) and the checks that compare the model's
    outputs ran, else "fail" or "inconclusive" (the rule lives in gates/core/binding.py, which `serve` re-applies)."""
    return verdict_from_counts(status_counts(results), None, missing_evidence(result_records(results)))


def result_records(results: Iterable[Result]) -> list[dict[str, Any]]:
    """The fields of each result that the evidence rule reads, as report.json has them."""
    return [{"id": r.id, "status": Status(r.status).value, "reason": r.reason, "metrics": r.metrics} for r in results]


def derive_seed(seed: int, check_id: str) -> int:
    """Stable across processes and Python versions (hash() is salted), so checks are order-independent."""
    return zlib.crc32(f"{seed}:{check_id}".encode())


def load_all_checks() -> list[Check]:
    """Import every module in k3verify.gates.checks (registering its checks) and return all checks. Imported
    here, not at the top: the suite engine runs without any model code, and importing registers."""
    import k3verify.gates.checks  # noqa: F401

    return list(REGISTRY)


def check_import_errors() -> dict[str, str]:
    """Check modules that failed to import (module -> traceback); see k3verify.gates.checks."""
    from k3verify.gates.checks import IMPORT_ERRORS

    return dict(IMPORT_ERRORS)


def _matches(check_id: str, pattern: str) -> bool:
    # A bare prefix like "kda" or "kda.conv" selects that subtree, as a glob would with ".*".
    return fnmatch.fnmatchcase(check_id, pattern) or check_id.startswith(pattern + ".")


def select_checks(checks: Iterable[Check], suite: str, only: Sequence[str] | None = None) -> list[Check]:
    """Checks of `suite`, narrowed by glob patterns over ids. A pattern that selects nothing is a
    UsageError naming it (a typo must not turn into a green run of zero checks)."""

    every = sorted(checks, key=lambda c: c.id)
    in_suite = [c for c in every if suite in c.suites]
    if not only:
        return in_suite
    chosen: dict[str, Check] = {}
    for pattern in only:
        hits = [c for c in in_suite if _matches(c.id, pattern)]
        if not hits:
            elsewhere = [c.id for c in every if _matches(c.id, pattern)]
            hint = f" (only in another suite: {', '.join(elsewhere[:5])})" if elsewhere else ""
            raise UsageError(f"--only {pattern!r} matches no check in suite {suite!r}{hint}")
        chosen.update((c.id, c) for c in hits)
    return sorted(chosen.values(), key=lambda c: c.id)


def gate_checks(checks: Iterable[Check], suite: str) -> list[Check]:
    """The checks of `suite` that a run able to open the serve gate selects (no --only, no --endpoint): a report
    that vouches for serving must hold every one."""
    return [c for c in select_checks(checks, suite) if not c.id.startswith(ENDPOINT_PREFIX)]


def make_context_factory(target: Target, *, device: str | torch.device, seed: int, suite: str,
                         dtype: torch.dtype = torch.bfloat16, cache: dict[str, Any] | None = None,
                         endpoint: EndpointSession | None = None,
                         parallel: tuple[int, int] | None = None, measure_noise: bool = False,
                         slicer: Callable[[CheckContext], tuple[CheckContext, str]] | None = None) -> ContextFactory:
    """The hook `parity` uses: one shared cache per run (pass `cache` to read coverage after the run), a fresh
    generator per check; `parallel` is the (tp, ep) layout the dist.* checks run; each noise-barred check gets its
    recorded noise (`measure_noise` ignores the recording: tools/measure_noise.py regenerates it); `slicer` runs a
    check that skipped for size again on a slice of the model (gates/shared/slice.py)."""
    shared: dict[str, Any] = {} if cache is None else cache
    dev = torch.device(device)

    def factory(check: Check, generator: torch.Generator) -> CheckContext:
        found = None
        if check.noise is not None:
            found = (NoiseLookup(None, None, "noise measured on request (--measure-noise)") if measure_noise
                     else noise_lookup(target, dev.type, seed, check.id))
        return CheckContext(target, dev, seed, generator, suite, shared, endpoint, dtype=dtype, level=check.level,
                            parallel=parallel, noise=found, slicer=slicer)

    return factory


def covered_dtypes(results: Iterable[Result]) -> list[str]:
    """The serving dtypes the run's checks that ran (not skipped) built their served model in, sorted: the run's
    `dtypes`, which `serve` recomputes the same way (gates/core/binding.py)."""
    return dtypes_of_run((Status(r.status).value, r.serving_dtypes) for r in results)


def run_check(check: Check, ctx_factory: ContextFactory, seed: int, device_kind: str) -> Result:
    """Run one check to a Result. Every exception becomes an `error` Result with its traceback."""
    check_seed = derive_seed(seed, check.id)
    start = time.perf_counter()
    ctx: CheckContext | None = None
    peaks = PeakMemory(device_kind)

    def attempt() -> Result:
        nonlocal ctx
        # Global RNG too: code under test (module init, dropout) may draw from it despite ctx.generator.
        torch.manual_seed(check_seed)
        generator = torch.Generator().manual_seed(check_seed)
        ctx = ctx_factory(check, generator)
        try:
            result = evaluate_trial(check, check.fn(ctx), ctx.noise)
        except SkipCheck as exc:
            if ctx.slicer is None or not exc.reason.startswith(SIZE_SKIP):
                raise
            result = _run_on_slice(check, ctx, exc.reason, check_seed)
        result.notes.extend(ctx.run_notes)
        return result

    try:
        if device_kind not in check.devices:
            raise SkipCheck(f"needs {' or '.join(check.devices)}; this run is on {device_kind}")
        try:
            result = attempt()
        except torch.OutOfMemoryError:
            if ctx is None:
                raise
            # The run's cached models filled the card (at real size they do not all fit at once): the check runs
            # again from its start with none of them cached, and says so.
            dropped = drop_cached_models(ctx.cache)
            result = attempt()
            result.notes.insert(0, f"ran a second time after running out of CUDA memory, with the run's cached "
                                   f"models dropped ({', '.join(dropped) or 'none were cached'})")
    except SkipCheck as exc:
        result = bare_result(check, Status.SKIPPED, exc.reason)
    except BadTargetData:
        raise  # the target's stored data is bad: every check would say so; the run stops (parity: exit 2)
    except Exception as exc:
        result = bare_result(check, Status.ERROR, f"{type(exc).__name__}: {exc}")
        result.traceback = traceback.format_exc()
    result.seed = check_seed
    result.duration_s = time.perf_counter() - start
    peaks.record(result.metrics)
    result.serving_dtypes = [] if ctx is None else sorted(ctx.serving_dtypes)
    return result


def holds_a_model(value: Any) -> bool:
    """Whether a cached value is a model, or a layer-at-a-time oracle (its `ref`), which may hold device memory."""
    return isinstance(value, torch.nn.Module) or isinstance(getattr(value, "ref", None), torch.nn.Module)


def drop_cached_models(cache: dict[str, Any]) -> list[str]:
    """Drop every model the run caches (and those of a cache nested in it: a slice's) and return the allocator's
    unused memory to the card; their keys, in the order dropped."""
    dropped = []
    for holder in [cache, *(v for v in cache.values() if isinstance(v, dict))]:
        for key in [k for k, v in holder.items() if holds_a_model(v)]:
            del holder[key]
            dropped.append(key)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dropped


def _run_on_slice(check: Check, ctx: CheckContext, why: str, check_seed: int) -> Result:
    """The check again on a slice of the model (ctx.slicer) after it skipped for size `why`: its result says
    so in its first note; a slice that still does not fit skips for size, naming both."""
    assert ctx.slicer is not None
    try:
        sliced, described = ctx.slicer(ctx)
        torch.manual_seed(check_seed)
        sliced.generator = torch.Generator().manual_seed(check_seed)
        try:
            result = evaluate_trial(check, check.fn(sliced), sliced.noise)
        finally:
            ctx.serving_dtypes |= sliced.serving_dtypes
    except SkipCheck as exc:
        if not exc.reason.startswith(SIZE_SKIP):
            raise
        raise SkipCheck(f"{why}; on a slice: {exc.reason.removeprefix(SIZE_SKIP).strip()}") from None
    result.notes[:0] = [f"ran on a slice of the model, {described} (whole: {why.removeprefix(SIZE_SKIP).strip()})"]
    result.notes.extend(sliced.run_notes)
    return result


def bare_result(check: Check, status: Status, reason: str) -> Result:
    return Result(id=check.id, component=check.component, level=check.level, kind=check.kind.value,
                  bar=check.bar, bar_reason=check.bar_reason, status=status, reason=reason,
                  bar_source=check.bar_source)


def import_error_results(import_errors: Mapping[str, str]) -> list[Result]:
    """A check module that fails to import would silently drop its checks: make each one an error."""
    out = []
    for module, tb in sorted(import_errors.items()):
        # Ids must match the schema's dotted lower_snake pattern whatever the file is called.
        short = re.sub(r"[^a-z0-9_]", "_", module.rsplit(".", 1)[-1].lower()) or "module"
        last = tb.strip().splitlines()[-1] if tb.strip() else "import failed"
        out.append(Result(id=f"gates.import.{short}", component="gates", level="module", kind="bitexact",
                          bar=None, bar_reason=None, status=Status.ERROR,
                          reason=f"check module {module} failed to import: {last}", traceback=tb))
    return out


def run_suite(
    checks: Sequence[Check],
    ctx_factory: ContextFactory,
    *,
    seed: int = 0,
    suite: str = "quick",
    device: str | torch.device = "cpu",
    info: RunInfo | None = None,
    import_errors: Mapping[str, str] | None = None,
    on_start: Callable[[Check], None] | None = None,
    on_result: Callable[[Result], None] | None = None,
) -> RunResult:
    """Run `checks` in order and return results plus run metadata (collected if `info` is None)."""
    device_kind = torch.device(device).type
    info = info or collect_run_info(device=device, seed=seed, suite=suite)
    # Microseconds: `serve` orders reports by this string, and two runs can start within one second.
    info.started_at = info.started_at or datetime.now(UTC).isoformat(timespec="microseconds")
    start = time.perf_counter()
    results = import_error_results(import_errors or {})
    for check in checks:
        if on_start is not None:
            on_start(check)
        result = run_check(check, ctx_factory, seed, device_kind)
        results.append(result)
        if on_result is not None:
            on_result(result)
    info.wall_time_s = time.perf_counter() - start
    return RunResult(info, results)


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _git(*args: str) -> str | None:
    root = Path(k3verify.__file__).resolve().parent.parent
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def device_name(device: str | torch.device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine() or dev.type


def recorded_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The K3V_ variables a report records; a secret's (K3V_API_KEY, say) value is replaced by a note."""
    return {k: "(set; a secret, not recorded)" if any(m in k.upper() for m in SECRET_MARKERS) else v
            for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIX)}


def collect_run_info(
    *,
    device: str | torch.device,
    seed: int,
    suite: str,
    preset: str | None = None,
    checkpoint: str | Path | None = None,
    checkpoint_digest: str | None = None,
    only: Sequence[str] = (),
    oracle: Mapping[str, Any] | None = None,
) -> RunInfo:
    sha = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain") if sha else None
    return RunInfo(
        k3verify_version=k3verify.__version__,
        git_sha=sha or "unknown",
        git_dirty=None if status is None else bool(status),
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=_dist_version("transformers"),
        fla=_dist_version("flash-linear-attention", "fla-core"),
        device=torch.device(device).type,
        device_name=device_name(device),
        preset=preset,
        checkpoint=None if checkpoint is None else str(checkpoint),
        checkpoint_digest=checkpoint_digest,
        seed=seed,
        suite=suite,
        only=list(only),
        oracle=dict(oracle or {}),
        environment=recorded_environment(os.environ),
        source_digest=source_digest(),
    )
