"""`k3verify plan`: per-rank memory of a tensor/expert-parallel serving configuration, on the meta device.

Weights (MXFP4 experts packed), MLA latent cache, KDA state pool, the prefix cache's snapshot budget,
block-residual buffer and the peak transients of one prefill step of --segment tokens at --context, per rank; a
table and, with --json, the same numbers as JSON. `--measure` (GPU, one rank) runs that step and prints predicted
against measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from k3verify.commands import Subparsers
from k3verify.config import ConfigError, ModelConfig
from k3verify.errors import UsageError
from k3verify.plan.device_fit import KNOWN_CARDS, device_memory_gib
from k3verify.plan.memory import EXPERT_MODES, PlanRequest, RankPlan, plan
from k3verify.presets import PRESETS, get_preset
from k3verify.serving.parallel.layout import LayoutError, ParallelLayout
from k3verify.serving.prefix_reuse import DEFAULT_SNAPSHOTS

GIB = 2**30
MEASURE_TOLERANCE = 0.10


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("plan", help="per-rank memory of a parallel serving configuration (meta device)",
                              description=__doc__.splitlines()[0] if __doc__ else None)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, metavar="NAME", help="model shape (default k3)")
    src.add_argument("--checkpoint", type=Path, metavar="DIR", help="a checkpoint's config.json")
    p.add_argument("--gpus", type=int, default=1, metavar="N", help="ranks (one GPU each)")
    p.add_argument("--tp", type=int, metavar="N", help="tensor-parallel degree (1 or --gpus; default --gpus)")
    p.add_argument("--ep", type=int, metavar="M", help="expert-parallel degree (1 or --gpus; default --gpus)")
    p.add_argument("--context", type=int, default=131072, metavar="N", help="tokens each sequence holds")
    p.add_argument("--batch", type=int, default=1, metavar="B", help="sequences held at once")
    p.add_argument("--segment", type=int, default=None, metavar="S",
                   help="new tokens in one prefill step (default min(context, 8192))")
    p.add_argument("--experts", choices=EXPERT_MODES, default="packed",
                   help="MXFP4 experts kept packed, or with the bf16 copy the grouped-GEMM path caches")
    p.add_argument("--prefix-snapshots", type=int, default=DEFAULT_SNAPSHOTS, metavar="N",
                   help=f"the prefix cache's snapshot budget, in snapshots (serve's default {DEFAULT_SNAPSHOTS}; 0: "
                        "--no-prefix-cache)")
    p.add_argument("--gpu-memory-gib", type=float, default=None, metavar="G",
                   help=f"one card's memory (default: read from this machine's CUDA device; {KNOWN_CARDS})")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the plan as JSON")
    p.add_argument("--measure", action="store_true", help="GPU: run the step and compare with the plan")
    p.set_defaults(func=run_plan)


def _config(args: argparse.Namespace) -> tuple[str, ModelConfig]:
    if args.checkpoint is not None:
        try:
            return args.checkpoint.name, ModelConfig.from_file(args.checkpoint)
        except (OSError, ConfigError, KeyError, TypeError) as exc:
            raise UsageError(f"--checkpoint {args.checkpoint}: {exc}") from exc
    name = args.preset or "k3"
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return name, get_preset(name)


def request_from(args: argparse.Namespace) -> PlanRequest:
    if args.gpus < 1:
        raise UsageError(f"--gpus must be >= 1; got {args.gpus}")
    tp = args.gpus if args.tp is None else args.tp
    ep = args.gpus if args.ep is None else args.ep
    try:
        world = ParallelLayout(tp, ep).world
    except LayoutError as exc:
        raise UsageError(str(exc)) from None
    if world != args.gpus:
        raise UsageError(f"--tp {tp} --ep {ep} is a world of {world} ranks, but --gpus is {args.gpus}")
    segment = args.segment if args.segment is not None else min(args.context, 8192)
    try:
        return PlanRequest(tp, ep, args.context, args.batch, segment, torch.bfloat16, args.experts,
                           prefix_snapshots=args.prefix_snapshots)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f}"


def render(name: str, req: PlanRequest, ranks: list[RankPlan], capacity_gib: float) -> str:
    head = (f"{name}: tp={req.tp} ep={req.ep} ({max(req.tp, req.ep)} GPUs), context {req.context:,}, batch "
            f"{req.batch}, prefill segment {req.segment:,}, experts {req.experts}, prefix-cache snapshots "
            f"{req.prefix_snapshots}; GiB per rank")
    cols = ["ranks", "weights", "expert bf16 copy", "MLA cache", "KDA state", "prefix snapshots", "block residual",
            "transients", "total", f"fits {capacity_gib:g} GiB"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in ranks:
        who = f"{r.ranks[0]}" if len(r.ranks) == 1 else f"{len(r.ranks)} ranks ({r.ranks[0]}..{r.ranks[-1]})"
        cells = [who, _gib(r.weights), _gib(r.expert_bf16_copy), _gib(r.mla_cache), _gib(r.kda_state),
                 _gib(r.prefix_snapshots), _gib(r.block_residual), f"{_gib(r.transient)} ({r.transient_at})",
                 _gib(r.total),
                 "yes" if r.total <= capacity_gib * GIB else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    name, cfg = _config(args)
    req = request_from(args)
    if args.measure:
        return _run_measure(args, name, cfg, req)
    try:
        ranks = plan(cfg, req)
    except LayoutError as exc:
        raise UsageError(str(exc)) from None
    if args.gpu_memory_gib is None:
        try:
            args.gpu_memory_gib = device_memory_gib()
        except ValueError as exc:
            raise UsageError(f"--gpu-memory-gib: {exc}") from None
    print(render(name, req, ranks, args.gpu_memory_gib))
    if args.json is not None:
        data: dict[str, Any] = {"model": name, "request": {**vars(req), "dtype": str(req.dtype)},
                                "gpu_memory_gib": args.gpu_memory_gib, "ranks": [r.to_dict() for r in ranks]}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0 if all(r.total <= args.gpu_memory_gib * GIB for r in ranks) else 1


def _run_measure(args: argparse.Namespace, name: str, cfg: ModelConfig, req: PlanRequest) -> int:
    from k3verify.plan.measure import measure

    if not torch.cuda.is_available():
        raise UsageError("--measure needs a CUDA device")
    result = measure(cfg, req, torch.device("cuda"))
    result["model"] = name
    pred, got = result["predicted"], result["measured"]
    rows = [("weights (+ expert copy)", pred["weights"] + pred["expert_bf16_copy"], got["resident_after_warmup"]
             - got["caches"]), ("caches", pred["mla_cache"] + pred["kda_state"], got["caches"]),
            ("transients (+ block buffer)", pred["transient"] + pred["block_residual"], got["transient"]),
            ("peak", pred["total"], got["peak"])]
    rows += [(f"inside {k}", v, got["kinds"].get(k, 0)) for k, v in result["predicted_kinds"].items()]
    print(f"{name}: context {req.context:,}, segment {req.segment:,}, experts {result['experts_mode']} (GiB)")
    print("| what | predicted | measured | predicted/measured |\n|---|---|---|---|")
    for what, p, m in rows:
        print(f"| {what} | {_gib(p)} | {_gib(m)} | {p / m if m else float('inf'):.3f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    ok = abs(result["ratio"] - 1.0) <= MEASURE_TOLERANCE
    print(f"peak: predicted/measured {result['ratio']:.3f} -> {'within' if ok else 'OUTSIDE'} "
          f"{MEASURE_TOLERANCE:.0%}")
    return 0 if ok else 1
