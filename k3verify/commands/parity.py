"""`k3verify parity`: run the parity gates on a preset or a checkpoint, write report.json / report.html /
junit.xml, and exit 0 (pass), 1 (any fail, vacuous or error), 2 (usage or setup problem) or 4 (inconclusive: nothing
red, but the checks that compare the model's outputs did not run, gates/core/evidence.py). A setup problem
with the target (a missing or unreadable shard, a bad config), and any run that started but could not finish (an
endpoint that cannot be verified, a crash), still writes a report, with verdict "error": a previous verdict never
stays in place.
"""

from __future__ import annotations

import argparse
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import torch

from k3verify.commands import Subparsers
from k3verify.commands.parity_endpoint import (
    endpoint_session,
    explain_endpoint,
    register_endpoint_args,
    select_endpoint_checks,
)
from k3verify.errors import UsageError
from k3verify.gates.core.binding import read_report_key
from k3verify.gates.core.check import Check, CheckContext
from k3verify.gates.core.suite import (
    RunInfo,
    RunResult,
    check_import_errors,
    collect_run_info,
    covered_dtypes,
    load_all_checks,
    make_context_factory,
    run_suite,
    select_checks,
)
from k3verify.gates.report.console import print_summary, progress_hooks
from k3verify.gates.report.json_report import writable_dir_problem, write_report_data, write_reports
from k3verify.gates.report.merge import MergeError, merge_parts
from k3verify.gates.shared.slice import slice_context
from k3verify.kernels.compile_watch import watch_compiles
from k3verify.oracle.pinning import report_pins
from k3verify.oracle.precision import PRECISIONS
from k3verify.peers.gguf_target import GgufTarget, gguf_target
from k3verify.peers.gguf_weights import GgufError
from k3verify.peers.quant_report import quant_report, write_quant_report
from k3verify.plan.device_fit import device_memory_gib
from k3verify.serving.parallel.layout import LayoutError, ParallelLayout
from k3verify.target import DEFAULT_PRESET, DEFAULT_REPORT_DIR, SERVING_DTYPES, Target, TargetError, resolve_target

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")
# 2 is a usage or setup error (cli.py); 3 is taken by the mutation runner's child for "imported the wrong copy"
EXIT_CODES = {"pass": 0, "fail": 1, "error": 1, "inconclusive": 4}


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("parity", help="run the parity gates and write reports",
                              description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--preset", metavar="NAME", help=f"synthetic preset (default {DEFAULT_PRESET})")
    p.add_argument("--checkpoint", metavar="DIR", type=Path, help="a checkpoint directory with config.json")
    p.add_argument("--suite", choices=("quick", "full"), default="quick")
    p.add_argument("--only", action="append", default=[], metavar="PATTERN",
                   help="glob over check ids, or an id prefix such as 'kda.conv' (repeatable)")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda")
    p.add_argument("--dtype", choices=list(PRECISIONS), default=None,
                   help="the serving dtype (default bfloat16): the served-model checks run in it and the report "
                        "records the dtypes covered (bfloat16 or float32); with --endpoint, the precision the "
                        "endpoint computes in (float16 too, or w4a8-q8act: MXFP4 experts times activations rounded "
                        "to Q8_0 blocks, as llama.cpp's CPU path)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-dir", type=Path, default=DEFAULT_REPORT_DIR, metavar="DIR")
    p.add_argument("--tp", type=int, metavar="N", help="tensor-parallel degree of the dist.* checks (adds them)")
    p.add_argument("--ep", type=int, metavar="M", help="expert-parallel degree of the dist.* checks (adds them)")
    p.add_argument("--list", action="store_true", help="list the selected checks and exit")
    p.add_argument("--merge", nargs="+", type=Path, metavar="DIR",
                   help="merge the reports of a gate run in parts (each part a `parity --only ...` run of the same "
                        "target, suite, seed, dtype and device; together every check once) into one report in "
                        "--report-dir, which `serve` judges as a run of one command; nothing else is run")
    p.add_argument("--verbose", action="store_true",
                   help="a line for every check as it finishes, with its wall time (and CUDA peak on a GPU)")
    p.add_argument("--weights-from", type=Path, metavar="GGUF",
                   help="the oracle (and our serving model) run on this GGUF file's weights, dequantized by gguf-py "
                        "and mapped back to the checkpoint's names; --dtype w-gguf-a8 adds llama.cpp's CPU "
                        "rounding of every matmul input for its weight types")
    p.add_argument("--report-key", type=Path, metavar="FILE",
                   help="sign report.json with this local key (HMAC-SHA256); `serve --report-key FILE` verifies")
    register_endpoint_args(p)
    p.set_defaults(func=run_parity)


def registered_checks() -> list[Check]:
    """Every registered check, after importing all check modules (a hook tests can replace)."""
    return load_all_checks()


def import_errors() -> dict[str, str]:
    return check_import_errors()


def validate_device(device: str) -> torch.device:
    if not _DEVICE_RE.match(device):
        raise UsageError(f"--device must be cpu or cuda (or cuda:N); got {device!r}")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
        device_memory_gib(dev)  # $K3V_CARD_GIB: the allocator held to a smaller card's memory from the start
        watch_compiles()  # a first run on a card compiles for minutes: say so
    return dev


def target_for(preset: str | None, checkpoint: Path | None) -> Target:
    """The command-line target (a hook tests can replace); every problem is a UsageError (exit 2)."""
    try:
        return resolve_target(preset, checkpoint)
    except TargetError as exc:
        flag = f"--checkpoint {checkpoint}" if checkpoint is not None else f"--preset {preset or DEFAULT_PRESET}"
        raise UsageError(f"{flag}: {exc}") from exc
def weights_from(target: Target, gguf: Path | None, dtype_name: str) -> Target:
    """`target` with its weights from `gguf` (--weights-from), or unchanged; every problem a UsageError (exit 2)."""
    if gguf is None:
        if dtype_name == "w-gguf-a8":
            raise UsageError("--dtype w-gguf-a8 is the arithmetic of a GGUF's weight types: give --weights-from GGUF")
        return target
    try:
        return gguf_target(target, gguf)
    except GgufError as exc:
        raise UsageError(f"--weights-from {gguf}: {exc}") from exc


def served_quantization(target: GgufTarget, cache: dict[str, object], accepted: list[Any],
                        report_dir: Path) -> dict[str, Any] | None:
    """The quantization report of the GGUF on the server's greedy answers (quant.json, quant.html beside the
    report; its summary for report.json), when the endpoint checks got answers."""
    answers = [g for g in cast(list[Any], cache.get("endpoint.greedy", [])) if g.tokens]
    if not answers or target.base is None:
        return None
    sequences = [(g.prompt + g.tokens, len(g.prompt)) for g in answers]
    server = [([s.top for s in g.answer.steps[:len(g.tokens)]], g.tokens) for g in answers]
    report = quant_report(target.base, target, sequences, server, accepted)
    write_quant_report(report, report_dir)
    print(report["headline"])
    weights = {k: v for k, v in report["weights"].items() if k != "tensors"}
    return {**report, "weights": weights, "files": ["quant.json", "quant.html"]}


def report_key(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return read_report_key(path)
    except ValueError as exc:
        raise UsageError(f"--report-key: {exc}") from exc


def write_setup_error_report(args: argparse.Namespace, device: torch.device, error: str, key: bytes | None) -> None:
    """A report with verdict "error" and the reason, for a run that never got to its checks (so CI that reads
    report.json sees the failure, and `serve` sees a newer non-passing run)."""
    info = collect_run_info(device=device, seed=args.seed, suite=args.suite, preset=args.preset,
                            checkpoint=args.checkpoint, only=args.only)
    info.started_at = datetime.now(UTC).isoformat(timespec="microseconds")
    write_reports(RunResult(info, [], setup_error=error), args.report_dir, key=key)


def _print_list(checks: list[Check]) -> None:
    for c in checks:
        bar = "noise" if c.noise is not None else ("-" if c.bar is None else f"{c.bar:g}")
        print(f"{c.id}\t{c.component}\t{c.level}\t{c.kind.value}\t{bar}\t{','.join(c.suites)}\t{c.control}")


def parallel_layout(tp: int | None, ep: int | None) -> tuple[int, int] | None:
    """(tp, ep) for the dist.* checks, or None when neither flag was given; a bad layout is a UsageError."""
    if tp is None and ep is None:
        return None
    layout = (1 if tp is None else tp, 1 if ep is None else ep)
    try:
        world = ParallelLayout(*layout).world
    except LayoutError as exc:
        raise UsageError(str(exc)) from None
    if world == 1:
        raise UsageError(f"--tp {layout[0]} --ep {layout[1]} is a world of one rank, the single-process model itself: "
                         "the dist.* checks compare a world of >= 2 ranks with it")
    return layout


def choose_checks(suite: str, only: list[str], parallel: tuple[int, int] | None) -> list[Check]:
    """The suite narrowed by --only; with --tp/--ep also the dist.* checks (they live in the full suite), all
    of them unless --only names some."""
    if parallel is None:
        return select_checks(registered_checks(), suite, only)
    dist = [p for p in only if p.startswith("dist")]
    rest = [p for p in only if not p.startswith("dist")]
    chosen = {c.id: c for c in select_checks(registered_checks(), "full", dist or ["dist"])}
    if rest or not only:
        chosen.update((c.id, c) for c in select_checks(registered_checks(), suite, rest))
    return sorted(chosen.values(), key=lambda c: c.id)


def merge_parity(args: argparse.Namespace) -> int:
    """`parity --merge DIR ...`: the parts' reports as one report in --report-dir (gates/report/merge.py)."""
    given = [f"--{name.replace('_', '-')}" for name in ("preset", "checkpoint", "endpoint", "weights_from", "tp", "ep")
             if getattr(args, name, None) is not None] + (["--only"] if args.only else [])
    if given:
        raise UsageError(f"--merge takes the parts' report directories only; {', '.join(given)} belong to the parts")
    try:
        merged = merge_parts(args.merge, registered_checks())
    except MergeError as exc:
        raise UsageError(str(exc)) from None
    write_report_data(merged, args.report_dir, key=report_key(args.report_key))
    counts, verdict = merged["summary"]["counts"], merged["summary"]["verdict"]
    print(f"{verdict.upper()} merged {len(args.merge)} parts, {merged['summary']['total']} checks "
          f"({', '.join(f'{n} {s}' for s, n in counts.items() if n)}): {args.report_dir / 'report.json'}")
    return EXIT_CODES[verdict]


def run_parity(args: argparse.Namespace) -> int:
    if args.merge:
        return merge_parity(args)
    if args.preset is not None and args.checkpoint is not None:
        raise UsageError("give --preset or --checkpoint, not both")
    device = validate_device(args.device)
    parallel = parallel_layout(args.tp, args.ep)
    try:
        checks = choose_checks(args.suite, args.only, parallel)
    except UsageError as exc:
        broken = ", ".join(import_errors())
        raise UsageError(f"{exc}; check modules that failed to import: {broken}" if broken else str(exc)) from None
    checks = select_endpoint_checks(checks, args)
    dtype_name = args.dtype or "bfloat16"
    if args.endpoint is None and dtype_name not in SERVING_DTYPES:
        raise UsageError(f"--dtype {dtype_name} applies to --endpoint runs only; a served model is one of "
                         f"{', '.join(SERVING_DTYPES)}")
    dtype = SERVING_DTYPES.get(dtype_name, torch.bfloat16)
    if args.list:
        _print_list(checks)
        for module, tb in import_errors().items():
            print(f"{module} failed to import: {tb.strip().splitlines()[-1]}", file=sys.stderr)
        return 0
    key = report_key(args.report_key)
    unwritable = writable_dir_problem(args.report_dir)
    if unwritable is not None:
        raise UsageError(f"--report-dir: {unwritable}; nothing was run")
    try:
        target = weights_from(target_for(args.preset, args.checkpoint), args.weights_from, dtype_name)
    except UsageError as exc:
        write_setup_error_report(args, device, str(exc), key)
        raise
    info = collect_run_info(device=device, seed=args.seed, suite=args.suite, preset=target.preset,
                            checkpoint=target.checkpoint_dir, checkpoint_digest=target.digest, only=args.only,
                            oracle=report_pins())
    if args.endpoint is not None:  # marks the run as an endpoint run from its start, even if it cannot finish
        info.endpoint = {"url": args.endpoint}
    try:
        run = _run_checks(args, target, device, dtype, parallel, checks, info)
        write_reports(run, args.report_dir, key=key)
    except BaseException as exc:
        # A run that started always leaves its own report: a stale verdict must never stay in place.
        reason = str(exc) if isinstance(exc, UsageError) else f"the run did not finish: {type(exc).__name__}: {exc}"
        info.endpoint = None if args.endpoint is None else {"url": args.endpoint, "error": reason}
        write_reports(RunResult(info, [], setup_error=reason), args.report_dir, key=key)
        raise
    print_summary(run, report_dir=str(args.report_dir))
    return EXIT_CODES[run.verdict]


def _run_checks(args: argparse.Namespace, target: Target, device: torch.device, dtype: torch.dtype,
                parallel: tuple[int, int] | None, checks: list[Check], info: RunInfo) -> RunResult:
    """The selected checks on the target (through the endpoint with --endpoint), the endpoint's record and
    explanation added; run.dtypes set."""
    cache: dict[str, object] = {}
    with endpoint_session(args, target, device) as endpoint:
        factory = make_context_factory(target, device=device, seed=args.seed, suite=args.suite, dtype=dtype,
                                       cache=cache, endpoint=endpoint, parallel=parallel,
                                       slicer=None if isinstance(target, GgufTarget) else slice_context)
        with progress_hooks(len(checks), verbose=args.verbose) as hooks:
            run = run_suite(checks, factory, seed=args.seed, suite=args.suite, device=device, info=info,
                            import_errors=import_errors(), on_start=hooks.on_start, on_result=hooks.on_result)
        if endpoint is not None:
            run.run.endpoint = endpoint.record()
            if isinstance(target, GgufTarget):
                run.run.endpoint["weights_from"] = target.describe()
                quantization = served_quantization(target, cache, endpoint.accepted, args.report_dir)
                if quantization is not None:
                    run.run.endpoint["quantization"] = quantization
            explain_ctx = CheckContext(target, device, args.seed, torch.Generator().manual_seed(args.seed), args.suite,
                                       cache, endpoint, dtype=dtype)
            explanation = explain_endpoint(args, run.results, explain_ctx)
            if explanation is not None:
                run.run.endpoint["explanation"] = explanation
    run.run.dtypes = covered_dtypes(run.results)
    return run
