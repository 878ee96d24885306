"""What `k3verify serve --tp N --ep M` adds to serve: the layout flags, the gate for that layout (the passing
report must hold every dist.* check, passed at exactly this layout) and the serving world (rank 0 here, the
followers spawned)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from k3verify.commands.serve_options import ServeOptions
from k3verify.errors import UsageError
from k3verify.serving.parallel.layout import LayoutError, ParallelLayout
from k3verify.serving.parallel.world import ServingWorld, WorldSpec
from k3verify.target import SERVING_DTYPES, Target

DIST_CHECKS = ("dist.tp.logits", "dist.ep.logits", "dist.layout.logits", "dist.greedy", "dist.ep.empty_rank",
               "dist.weights.slices")
DEFAULT_PAGES, DEFAULT_PAGE_SIZE = 256, 16  # build_runner's defaults


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel degree (ranks on this host)")
    p.add_argument("--ep", type=int, default=1, metavar="M", help="expert-parallel degree (ranks on this host)")


def layout_of(opts: ServeOptions) -> ParallelLayout:
    try:
        return ParallelLayout(opts.tp, opts.ep)
    except LayoutError as exc:
        raise UsageError(str(exc)) from None


def parity_flags(layout: ParallelLayout) -> list[str]:
    return [] if layout.world == 1 else ["--tp", str(layout.tp), "--ep", str(layout.ep)]


def dist_gate_reason(report: Path, layout: ParallelLayout) -> str | None:
    """Why `report` does not vouch for serving under `layout` (None: it does)."""
    results = {r["id"]: r for r in json.loads(report.read_text(encoding="utf-8"))["results"]}
    for check_id in DIST_CHECKS:
        r = results.get(check_id)
        if r is None or r["status"] != "pass":
            return f"{report}: {check_id} {'did not run' if r is None else r['status']}"
        got = (r["metrics"].get("tp"), r["metrics"].get("ep"))
        if got != (float(layout.tp), float(layout.ep)):
            return (f"{report}: the dist.* checks ran at tp={got[0]:g} ep={got[1]:g}, not tp={layout.tp} "
                    f"ep={layout.ep}")
    return None


def start_world(target: Target, opts: ServeOptions, layout: ParallelLayout) -> ServingWorld:
    pages = opts.num_pages or DEFAULT_PAGES
    page_size = opts.page_size or DEFAULT_PAGE_SIZE
    caches = {"num_pages": pages, "page_size": page_size, "num_slots": opts.max_batch,
              "max_context": min((pages - 1) * page_size, target.cfg.max_position_embeddings)}
    spec = WorldSpec(str(target.checkpoint_dir), layout.tp, layout.ep, torch.device(opts.device).type, caches,
                     dtype=SERVING_DTYPES[opts.dtype], names=target.names, digest=target.digest)
    try:
        return ServingWorld(target.cfg, spec)
    except (LayoutError, ValueError) as exc:
        raise UsageError(f"cannot serve with {layout.describe()}: {exc}") from exc
