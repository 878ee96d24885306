"""What `k3verify serve` was asked for: its flags, read once from the parsed command line into a typed, frozen object.

Every part of serve (the gate lookup, the engine build, the parallel world, the engine's own process, which
receives it pickled) reads these fields; nothing is added to them at run time (what serve builds, a parallel
serving world say, is held by the object that built it: commands/serve_engine.py's BuiltEngine)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from k3verify.commands.serve_keys import resolve_api_key


@dataclass(frozen=True)
class ServeOptions:
    preset: str | None
    checkpoint: Path | None
    report_dir: Path
    host: str
    allowed_host: tuple[str, ...]
    port: int
    api_key: str | None
    report_key: Path | None
    max_report_age: float  # days
    run_gates: bool
    device: str
    dtype: str
    max_batch: int
    num_pages: int | None
    page_size: int | None
    max_step_tokens: int
    admit_quiet_ms: float
    admit_max_hold_ms: float
    prefill_graphs: bool
    debug: bool
    no_warmup: bool
    nonfinite_threshold: int
    max_restarts: int
    health_window: float
    speculative: str | None
    num_draft: int
    spec_min_accept: float
    no_spec_cost_policy: bool
    kda_fused_score: bool
    api_in_process: bool
    tp: int
    ep: int
    no_prefix_cache: bool = False
    prefix_cache_per_key: bool = False
    prefix_snapshots: int = 64  # serving/prefix_reuse.py DEFAULT_SNAPSHOTS (serve's parser passes it)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        """The options of a `serve` command line as the serve parser parsed it; a missing flag raises naming it."""
        missing = [f.name for f in fields(cls) if not hasattr(args, f.name)]
        if missing:
            raise ValueError(f"not a parsed `serve` command line: no {', '.join(missing)}")
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        values["allowed_host"] = tuple(values["allowed_host"])
        values["api_key"] = resolve_api_key(args.api_key, getattr(args, "api_key_file", None))
        return cls(**values)
