"""`weights.reconcile.buckets`: an edited, header-only copy of the run's checkpoint (a dropped tensor, half of an
MXFP4 pair dropped, a transposed non-square tensor, a re-typed tensor, unknown tensors); each edit must land in
its reconcile bucket, which an index-only reconcile (the control) cannot see for the shape and dtype edits.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from k3verify.checkpoint.buckets import ReconcileResult, reconcile_checkpoint
from k3verify.checkpoint.names import ignorable_reason
from k3verify.checkpoint.reader import CheckpointReader
from k3verify.checkpoint.synthetic import SYNTHETIC_SHARD_MAX_BYTES
from k3verify.checkpoint.tolerances import A_LOG_PADDING, dtype_rule
from k3verify.checkpoint.writer import write_sparse_checkpoint
from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared.checkpoint_edits import DROPPED, UNKNOWN_IN_PREFIX, UNKNOWN_OUTSIDE

Spec = tuple[tuple[int, ...], torch.dtype]


def _pick_edits(specs: dict[str, Spec], prefix: str) -> tuple[str, str | None, str, str, list[str]]:
    """(dropped, half of an MXFP4 pair or None, transposed, re-typed, unknown names): distinct text-model tensors,
    the transposed one non-square 2-D float, the re-typed one bf16 with no dtype tolerance for f32."""
    text_names = [n for n in specs if ignorable_reason(n) is None]
    dropped = prefix + DROPPED
    if dropped not in specs:
        raise SkipCheck(f"checkpoint has no {dropped}")
    half = next((n for n in text_names if n.endswith(".weight_scale")), None)
    taken = {dropped, half}
    transposed = next((n for n in text_names if n not in taken and len(specs[n][0]) == 2
                       and specs[n][0][0] != specs[n][0][1] and specs[n][1] != torch.uint8), None)
    if transposed is None:
        raise SkipCheck("checkpoint has no non-square 2-D float tensor to transpose")
    taken.add(transposed)
    retyped = next((n for n in text_names if n not in taken and specs[n][1] == torch.bfloat16
                    and dtype_rule(n, torch.float32, torch.bfloat16) is None), None)
    if retyped is None:
        raise SkipCheck("checkpoint has no further bf16 tensor to re-type")
    return dropped, half, transposed, retyped, [prefix + UNKNOWN_IN_PREFIX] + ([UNKNOWN_OUTSIDE] if prefix else [])


def _reconcile_runs(ctx: CheckContext, edited: dict[str, Spec]) -> tuple[ReconcileResult, ...]:
    """(clean, clean index-only, edited copy, edited copy index-only): the copy is header-only, in a temp dir."""
    base, cfg, hf = ctx.checkpoint_dir, ctx.cfg, ctx.target.names == "transformers"
    with tempfile.TemporaryDirectory(prefix="k3v-reconcile-") as tmp:
        copy = Path(tmp) / "edited"
        cfg_dict = json.loads((base / "config.json").read_text())
        write_sparse_checkpoint(cfg_dict, edited, copy, shard_max_bytes=SYNTHETIC_SHARD_MAX_BYTES,
                                generation_config=None)
        return (reconcile_checkpoint(base, cfg=cfg, hf_names=hf),
                reconcile_checkpoint(base, cfg=cfg, index_only=True, hf_names=hf),
                reconcile_checkpoint(copy, cfg=cfg, hf_names=hf),
                reconcile_checkpoint(copy, cfg=cfg, index_only=True, hf_names=hf))


@register_check(
    id="weights.reconcile.buckets", component="weights", level="module", kind=Kind.BITEXACT,
    control="an index-only reconcile, which reads no headers and so cannot see a transposed or re-typed tensor",
)
def check_reconcile_buckets(ctx: CheckContext) -> Trial:
    cfg = ctx.cfg
    entries = CheckpointReader(ctx.checkpoint_dir).entries
    specs = {name: (tuple(e.shape), e.torch_dtype) for name, e in entries.items()}
    dropped, half, transposed, retyped, unknown = _pick_edits(specs, cfg.checkpoint_prefix)
    edited = {n: s for n, s in specs.items() if n not in (dropped, half)}
    edited[transposed] = (tuple(reversed(specs[transposed][0])), specs[transposed][1])
    edited[retyped] = (specs[retyped][0], torch.float32)
    for name in unknown:
        edited[name] = ((4, 4), torch.bfloat16)
    n_ignored = sum(ignorable_reason(n) is not None for n in specs)
    mod = len(cfg.checkpoint_prefix)

    def header_flags(clean: ReconcileResult, res: ReconcileResult) -> list[int]:
        mismatched = {(m.checkpoint_name, m.kind) for m in res.mismatched}
        partial = {(p.present, p.missing) for p in res.partial}
        expected_partial = set() if half is None else {(half.replace(".weight_scale", ".weight_packed"), half)}
        n_missing = 1 + (half is not None) + 2  # dropped, the half pair, transposed, retyped
        return [
            int(clean.ok and clean.num_matched == clean.num_expected and len(clean.ignored) == n_ignored),
            int(res.no_source == [dropped[mod:]]),
            int(partial == expected_partial),
            int({u.name for u in res.no_destination} == set(unknown) and len(res.no_destination) == len(unknown)),
            int((transposed, "shape") in mismatched),
            int((retyped, "dtype") in mismatched),
            int(len(res.mismatched) == 2),
            int(res.num_matched == res.num_expected - n_missing),
        ]

    def index_flags(res: ReconcileResult) -> list[int]:
        return [int(res.no_source == [dropped[mod:]]),
                int({u.name for u in res.no_destination} == set(unknown)),
                int(not res.mismatched)]

    clean, clean_index, headers, index_only = _reconcile_runs(ctx, edited)
    labels = ["clean_ok", "dropped_no_source", "half_pair_partial", "unknown_no_destination", "transposed_mismatch",
              "retyped_mismatch", "exactly_two_mismatched", "matched_count"]
    ones = torch.ones(len(labels), dtype=torch.int64)
    cand = torch.tensor(header_flags(clean, headers), dtype=torch.int64)
    ctrl = torch.tensor(header_flags(clean_index, index_only), dtype=torch.int64)
    idx = torch.tensor(index_flags(index_only), dtype=torch.int64)
    return Trial(
        reference={"headers": ones, "index_only": torch.ones(3, dtype=torch.int64)},
        candidate={"headers": cand, "index_only": idx},
        control={"headers": ctrl, "index_only": idx},
        metrics={"tensors": float(len(specs)),
                 **{f"tolerated_{rule}": float(n) for rule, n in clean.rules_used().items()}},
        notes=[f"headers flags: {labels}; index_only flags: [dropped_no_source, unknown_no_destination, "
               f"no_mismatch_visible]",
               f"edits: dropped {dropped}, half pair {half}, transposed {transposed} {specs[transposed][0]}, "
               f"re-typed {retyped} bf16->f32, unknown {unknown}",
               f"candidate counts: {headers.to_dict()['counts']}; control (index-only) counts: "
               f"{index_only.to_dict()['counts']}",
               f"names: {clean.names}; tolerance rules used by the clean checkpoint: {clean.rules_used() or 'none'}",
               *(f"tolerated ({t.rule}): {t.checkpoint_name}: {t.detail}" for t in clean.tolerated
                 if t.rule == A_LOG_PADDING.id)],
    )
