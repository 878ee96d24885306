"""`k3verify checkpoint make | reconcile | inspect`: write, check and describe checkpoint directories."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from k3verify.checkpoint.digest import checkpoint_digest
from k3verify.checkpoint.reader import CheckpointError, CheckpointReader
from k3verify.checkpoint.reconcile import Mismatch, PartialSlot, ReconcileResult, Unplaced, reconcile_checkpoint
from k3verify.checkpoint.synthetic import make_sparse_checkpoint, make_synthetic_checkpoint
from k3verify.cli import Subparsers, UsageError
from k3verify.config import ConfigError, ModelConfig
from k3verify.presets import PRESETS, SYNTHETIC_PRESETS

EXAMPLES_PER_BUCKET = 5


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("checkpoint", help="write, reconcile and inspect checkpoints",
                                   description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)

    make = sub.add_parser("make", help="write a preset's synthetic checkpoint (deterministic bytes)")
    make.add_argument("--preset", required=True, choices=PRESETS, metavar="NAME",
                      help=f"synthetic: {', '.join(SYNTHETIC_PRESETS)}; any preset with --sparse")
    make.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    make.add_argument("--sparse", action="store_true",
                      help="exact names/shapes/dtypes, all-zero data in sparse files (real shapes: reconcile/plan "
                           "fixtures, not a model)")
    make.add_argument("--force", action="store_true", help="replace OUT if it exists")
    make.add_argument("out", type=Path, metavar="OUT")
    make.set_defaults(func=cmd_make)

    rec = sub.add_parser("reconcile", help="compare a checkpoint with the model's expected tensors (4 buckets)")
    rec.add_argument("dir", type=Path, metavar="DIR")
    rec.add_argument("--index-only", action="store_true",
                     help="read only the index json: names, no shapes/dtypes (cannot see a transposed tensor)")
    rec.add_argument("--json", action="store_true", help="print the full result as JSON")
    rec.set_defaults(func=cmd_reconcile)

    ins = sub.add_parser("inspect", help="config summary, tensor/shard counts and digest")
    ins.add_argument("dir", type=Path, metavar="DIR")
    ins.set_defaults(func=cmd_inspect)


def cmd_make(args: argparse.Namespace) -> int:
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0; got {args.seed}")
    if not args.sparse and args.preset not in SYNTHETIC_PRESETS:
        raise UsageError(f"preset {args.preset!r} is a real shape and cannot be materialised; use one of "
                         f"{', '.join(SYNTHETIC_PRESETS)}, or --sparse for a headers-only fixture")
    if args.sparse and args.seed:
        raise UsageError("--sparse writes no weights; --seed does not apply")
    try:
        if args.sparse:
            written = make_sparse_checkpoint(args.preset, args.out, overwrite=args.force)
        else:
            written = make_synthetic_checkpoint(args.preset, args.out, args.seed, overwrite=args.force)
    except FileExistsError as exc:
        raise UsageError(f"{exc} (use --force)") from exc
    print(f"wrote {written.path}")
    print(f"  preset {args.preset}, seed {args.seed}{' (sparse: zero data)' if args.sparse else ''}")
    print(f"  {written.num_tensors} tensors in {len(written.shard_files)} shards, {written.total_size} data bytes")
    print(f"  digest {checkpoint_digest(written.path)}")
    return 0


def _load(args: argparse.Namespace) -> ModelConfig:
    if not args.dir.is_dir():
        raise UsageError(f"{args.dir}: not a directory")
    try:
        return ModelConfig.from_file(args.dir)
    except (ConfigError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from exc


def cmd_reconcile(args: argparse.Namespace) -> int:
    cfg = _load(args)
    try:
        result = reconcile_checkpoint(args.dir, index_only=args.index_only, cfg=cfg)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from exc
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(format_reconcile(result))
    return 0 if result.ok else 1


def format_reconcile(result: ReconcileResult) -> str:
    lines = [f"checkpoint {result.checkpoint} ({result.mode})",
             f"  checkpoint tensors {result.num_checkpoint_tensors}, expected {result.num_expected}, "
             f"found {result.num_matched}, missing {result.num_expected - result.num_matched}"]
    labels = {"a_no_source": "(a) parameter without a source",
              "b_partial": "(b) slot with a partial source",
              "c_no_destination": "(c) tensor without a destination",
              "d_mismatched": "(d) shape/dtype mismatch"}
    for key, items in result.buckets().items():
        lines.append(f"  {labels[key]:<36} {len(items)}")
        lines.extend(f"      {_describe(item)}" for item in items[:EXAMPLES_PER_BUCKET])
        if len(items) > EXAMPLES_PER_BUCKET:
            lines.append(f"      … and {len(items) - EXAMPLES_PER_BUCKET} more")
    reasons = Counter(u.reason for u in result.ignored)
    for reason, n in sorted(reasons.items()):
        lines.append(f"  ignorable: {n} tensor(s): {reason}")
    if result.mode == "index-only":
        lines.append("  note: index-only mode sees names only; shapes/dtypes (bucket d) are not checked")
    lines.append("  result: " + ("OK" if result.ok else "MISMATCH"))
    return "\n".join(lines)


def _describe(item: str | PartialSlot | Unplaced | Mismatch) -> str:
    if isinstance(item, PartialSlot):
        return f"{item.slot}: has {item.present}, lacks {item.missing}"
    if isinstance(item, Unplaced):
        return f"{item.name}: {item.reason}"
    if isinstance(item, Mismatch):
        return (f"{item.checkpoint_name}: {item.kind} {item.found_dtype}{list(item.found_shape)}, expected "
                f"{item.expected_dtype}{list(item.expected_shape)} for {item.module_name}")
    return item


def cmd_inspect(args: argparse.Namespace) -> int:
    cfg = _load(args)
    try:
        reader = CheckpointReader(args.dir)
        digest = checkpoint_digest(args.dir)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from exc
    dtypes = Counter(e.dtype for e in reader.entries.values())
    print(f"checkpoint {args.dir}")
    print(f"  model_type {cfg.model_type}, {cfg.num_hidden_layers} layers ({len(cfg.kda_layers)} KDA, "
          f"{len(cfg.full_attn_layers)} MLA), hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    print(f"  experts {cfg.num_experts} (top {cfg.num_experts_per_token}, {cfg.num_shared_experts} shared), "
          f"moe_intermediate {cfg.moe_intermediate_size}, latent {cfg.routed_expert_hidden_size}, "
          f"quant {cfg.quant.format if cfg.quant else 'none'}")
    print(f"  bos {cfg.bos_token_id}, eos {list(cfg.eos_token_ids)}, pad {cfg.pad_token_id}")
    print(f"  {len(reader)} tensors in {len(reader.shard_files)} shard(s), {reader.total_data_bytes} data bytes; "
          f"dtypes {dict(sorted(dtypes.items()))}")
    print(f"  digest {digest}")
    return 0
