"""`k3verify parity`: run the parity gates on a preset or a checkpoint, write report.json / report.html /
junit.xml, and exit 0 (pass), 1 (any fail, vacuous or error) or 2 (usage or setup problem).

Model-side modules (presets, config, checkpoint cache, digest, oracle pins) are imported inside the
command so that `--list`, `--only` validation and the engine's own tests work without them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3verify.cli import UsageError
from k3verify.gates.gate import Check
from k3verify.gates.suite import check_import_errors, load_all_checks

DEFAULT_PRESET = "k3-tiny"
DEFAULT_REPORT_DIR = Path("reports/latest")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class Target:
    """What the checks run against: the config, where its weights are, and the digest reports carry."""

    cfg: Any
    preset: str | None
    checkpoint_dir: Path | None
    digest: str | None
    oracle: dict[str, Any] = field(default_factory=dict)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("parity", help="run the parity gates and write reports",
                              description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--preset", metavar="NAME", help=f"synthetic preset (default {DEFAULT_PRESET})")
    p.add_argument("--checkpoint", metavar="DIR", type=Path, help="a checkpoint directory with config.json")
    p.add_argument("--suite", choices=("quick", "full"), default="quick")
    p.add_argument("--only", action="append", default=[], metavar="PATTERN",
                   help="glob over check ids, or an id prefix such as 'kda.conv' (repeatable)")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-dir", type=Path, default=DEFAULT_REPORT_DIR, metavar="DIR")
    p.add_argument("--list", action="store_true", help="list the selected checks and exit")
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
    return dev


def oracle_pins() -> dict[str, Any]:
    """Oracle pinning info (versions and sha256 of the vendored oracle files) for the report.
    Contract: `k3verify.oracle.pins.oracle_pins() -> dict`; absent module -> {}."""
    try:
        from k3verify.oracle import pins  # type: ignore[attr-defined]
    except ModuleNotFoundError as exc:
        if exc.name == "k3verify.oracle.pins":
            return {}
        return {"error": f"k3verify.oracle.pins failed to import: {exc}"}
    try:
        return dict(pins.oracle_pins())
    except Exception as exc:  # recorded, not hidden: the report shows pinning could not be established
        return {"error": f"{type(exc).__name__}: {exc}"}


def resolve_target(preset: str | None, checkpoint: Path | None) -> Target:
    """Build the config and find the weights; every problem is a UsageError (exit 2) naming it."""
    try:
        from k3verify.checkpoint.digest import checkpoint_digest
    except ImportError as exc:
        raise UsageError(f"checkpoint digests are not available ({exc})") from exc
    if checkpoint is not None:
        config_path = checkpoint / "config.json"
        if not config_path.is_file():
            raise UsageError(f"--checkpoint {checkpoint}: no config.json there")
        try:
            from k3verify.config import ModelConfig

            cfg = ModelConfig.from_hf_dict(json.loads(config_path.read_text(encoding="utf-8")))
        except ImportError as exc:
            raise UsageError(f"model config support is not available ({exc})") from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--checkpoint {config_path}: {exc}") from exc
        return Target(cfg, None, checkpoint, checkpoint_digest(checkpoint), oracle_pins())
    name = preset or DEFAULT_PRESET
    try:
        from k3verify.checkpoint.synthetic import ensure_preset_checkpoint
        from k3verify.presets import PRESETS, get_preset
    except ImportError as exc:
        raise UsageError(f"presets are not available ({exc})") from exc
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    try:
        cfg = get_preset(name)
        checkpoint_dir = Path(ensure_preset_checkpoint(name))
    except ValueError as exc:
        raise UsageError(f"--preset {name}: {exc}") from exc
    return Target(cfg, name, checkpoint_dir, checkpoint_digest(checkpoint_dir), oracle_pins())


def _print_list(checks: list[Check]) -> None:
    for c in checks:
        bar = "-" if c.bar is None else f"{c.bar:g}"
        print(f"{c.id}\t{c.component}\t{c.level}\t{c.kind.value}\t{bar}\t{','.join(c.suites)}\t{c.control}")


def run_parity(args: argparse.Namespace) -> int:
    from k3verify.gates.console import print_summary, progress_hooks
    from k3verify.gates.report import write_reports
    from k3verify.gates.suite import collect_run_info, make_context_factory, run_suite, select_checks

    if args.preset is not None and args.checkpoint is not None:
        raise UsageError("give --preset or --checkpoint, not both")
    device = validate_device(args.device)
    try:
        checks = select_checks(registered_checks(), args.suite, args.only)
    except UsageError as exc:
        broken = ", ".join(import_errors())
        raise UsageError(f"{exc}; check modules that failed to import: {broken}" if broken else str(exc)) from None
    if args.list:
        _print_list(checks)
        for module, tb in import_errors().items():
            print(f"{module} failed to import: {tb.strip().splitlines()[-1]}", file=sys.stderr)
        return 0
    target = resolve_target(args.preset, args.checkpoint)
    factory = make_context_factory(target.cfg, preset=target.preset, checkpoint_dir=target.checkpoint_dir,
                                   device=device, seed=args.seed, suite=args.suite)
    info = collect_run_info(device=device, seed=args.seed, suite=args.suite, preset=target.preset,
                            checkpoint=target.checkpoint_dir, checkpoint_digest=target.digest, only=args.only,
                            oracle=target.oracle)
    with progress_hooks(len(checks)) as hooks:
        run = run_suite(checks, factory, seed=args.seed, suite=args.suite, device=device, info=info,
                        import_errors=import_errors(), on_start=hooks.on_start, on_result=hooks.on_result)
    write_reports(run, args.report_dir)
    print_summary(run, report_dir=str(args.report_dir))
    return 0 if run.verdict == "pass" else 1
