"""`k3verify checkpoint make | reconcile | inspect`: write, check and describe checkpoint directories."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from k3verify.checkpoint.buckets import Mismatch, PartialSlot, ReconcileResult, Unplaced, reconcile_checkpoint
from k3verify.checkpoint.digest import checkpoint_digest
from k3verify.checkpoint.hf_interop import uses_transformers_names
from k3verify.checkpoint.names import checkpoint_specs
from k3verify.checkpoint.reader import CheckpointError, CheckpointReader, read_index
from k3verify.checkpoint.synthetic import make_sparse_checkpoint, make_synthetic_checkpoint
from k3verify.checkpoint.tolerances import A_LOG_PADDING, RULES
from k3verify.commands import Subparsers
from k3verify.config import ConfigError, ModelConfig
from k3verify.errors import UsageError
from k3verify.presets import PRESETS, get_preset
from k3verify.serving.parallel.layout import LayoutError, ParallelLayout, check_layout
from k3verify.serving.parallel.slice_reconcile import reconcile_slices

EXAMPLES_PER_BUCKET = 5


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("checkpoint", help="write, reconcile and inspect checkpoints",
                                   description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)

    make = sub.add_parser("make", help="write a preset's checkpoint with name-seeded data (deterministic bytes)")
    make.add_argument("--preset", required=True, choices=PRESETS, metavar="NAME",
                      help=f"any preset: {', '.join(PRESETS)} (real shapes are written shard by shard)")
    make.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    make.add_argument("--device", default="cpu", metavar="cpu|cuda",
                      help="generate the values on this device (cuda: fast at real size; other values than cpu)")
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
    rec.add_argument("--hf-names", action="store_true",
                     help="the directory was written by transformers: map its tensor names (fused conv, merged "
                          "experts, forget_gate.*, the dense layer's block_sparse_moe.* spelling) to ours first")
    rec.add_argument("--json", action="store_true", help="print the full result as JSON")
    rec.add_argument("--tp", type=int, default=1, metavar="N", help="also check every rank's slices (tensor parallel)")
    rec.add_argument("--ep", type=int, default=1, metavar="M", help="also check every rank's slices (expert parallel)")
    rec.set_defaults(func=cmd_reconcile)

    ins = sub.add_parser("inspect", help="config summary, tensor/shard counts and digest")
    ins.add_argument("dir", type=Path, metavar="DIR")
    ins.set_defaults(func=cmd_inspect)


def cmd_make(args: argparse.Namespace) -> int:
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0; got {args.seed}")
    if args.sparse and (args.seed or args.device != "cpu"):
        raise UsageError("--sparse writes no weights; --seed and --device do not apply")
    start = time.perf_counter()
    try:
        if args.sparse:
            written = make_sparse_checkpoint(args.preset, args.out, overwrite=args.force)
        else:
            _check_room(args.preset, args.out)
            written = make_synthetic_checkpoint(args.preset, args.out, args.seed, overwrite=args.force,
                                                device=_make_device(args.device), on_shard=_progress(start))
    except FileExistsError as exc:
        raise UsageError(f"{exc} (use --force)") from exc
    print(f"wrote {written.path} in {time.perf_counter() - start:.1f} s")
    print(f"  preset {args.preset}, seed {args.seed}{' (sparse: zero data)' if args.sparse else ''}")
    print(f"  {written.num_tensors} tensors in {len(written.shard_files)} shards, {written.total_size} data bytes")
    if args.sparse:  # hashing every byte of terabytes of holes would take an hour; nothing serves a fixture
        print("  digest not computed (sparse fixture; `k3verify checkpoint inspect` hashes every byte)")
    else:
        print(f"  digest {checkpoint_digest(written.path)}")
    return 0


def _make_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"--device {device!r}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine")
    return dev


def _check_room(preset: str, out: Path) -> None:
    """A checkpoint larger than the free disk is refused before anything is written (the full Kimi-Linear-48B is
    ~98 GB in bf16): such shapes are reconciled with --sparse and sized with `k3verify plan`."""
    need = sum(math.prod(s.shape) * s.dtype.itemsize for s in checkpoint_specs(get_preset(preset)).values())
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if need > free:
        raise UsageError(f"preset {preset!r} needs {need / 1e9:.1f} GB of data but {parent} has {free / 1e9:.1f} GB "
                         "free; write it with --sparse (exact headers, no data) to reconcile it, and size it with "
                         "`k3verify plan`")


def _progress(start: float) -> Callable[[str, int], None]:
    def report(file: str, nbytes: int) -> None:
        print(f"  {file}: {nbytes / 1e9:.2f} GB written (+{time.perf_counter() - start:.1f} s)", flush=True)
    return report


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
        result = reconcile_checkpoint(args.dir, index_only=args.index_only, cfg=cfg, hf_names=args.hf_names)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from exc
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(format_reconcile(result))
    if not result.ok and not args.hf_names and uses_transformers_names(cfg, read_index(args.dir).weight_map):
        print("  hint: these names are transformers' spellings; run again with --hf-names")
    slices_ok = _slices_ok(args, cfg)
    return 0 if result.ok and slices_ok else 1


def _slices_ok(args: argparse.Namespace, cfg: ModelConfig) -> bool:
    """With --tp/--ep: every rank's slices against the shard headers (serving/parallel/slice_reconcile.py)."""
    try:
        layout = ParallelLayout(args.tp, args.ep)
        if layout.world == 1:
            return True
        check_layout(cfg, layout)
        stored = {name: entry.shape for name, entry in CheckpointReader(args.dir).entries.items()}
    except (LayoutError, CheckpointError) as exc:
        raise UsageError(str(exc)) from exc
    problems = reconcile_slices(cfg, layout, stored)
    print(f"per-rank slices ({layout.describe()}): {'ok' if not problems else f'{len(problems)} problem(s)'}")
    for p in problems:
        print(f"  {p}")
    return not problems


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
    lines.extend(_tolerated_lines(result))
    if result.names == "transformers":
        lines.append("  names: transformers' spellings, mapped to ours (--hf-names)")
    if result.mode == "index-only":
        lines.append("  note: index-only mode sees names only; shapes/dtypes (bucket d) are not checked")
    lines.append("  result: " + ("OK" if result.ok else "MISMATCH"))
    return "\n".join(lines)


def _tolerated_lines(result: ReconcileResult) -> list[str]:
    """One line per named rule used (with its reason), then examples; every A_log padding is listed."""
    reasons = {rule.id: rule.reason for rule in RULES}
    lines = []
    for rule, n in result.rules_used().items():
        lines.append(f"  tolerated by rule {rule}: {n} tensor(s): {reasons[rule]}")
        items = [t for t in result.tolerated if t.rule == rule]
        shown = items if rule == A_LOG_PADDING.id else items[:EXAMPLES_PER_BUCKET]
        lines.extend(f"      {t.checkpoint_name}: {t.detail}" for t in shown)
        if len(items) > len(shown):
            lines.append(f"      … and {len(items) - len(shown)} more")
    return lines


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
