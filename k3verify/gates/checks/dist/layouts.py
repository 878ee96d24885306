"""Tensor / expert parallel against the single process (fp32, a gloo world on CPU): logits, greedy tokens,
an expert-parallel step where one rank's experts get no token, and the per-rank weight slices.

All of them read one session per run (`gates/shared/dist_common.session`): `k3verify parity --tp N --ep M` picks its
layout (world = max(N, M)); without the flags the full suite runs world 2 (tp 2, ep 2). Besides the asked
layout the session always runs TP only (tp = world, ep = 1) and EP only (tp = 1, ep = world).
"""

from __future__ import annotations

from typing import Any

import torch

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared.dist_common import (
    DIST_BAR,
    DIST_BAR_REASON,
    TIE_FRACTION,
    Session,
    depth_order,
    session,
)
from k3verify.gates.shared.dist_session import splits_anything
from k3verify.serving.parallel.layout import ParallelLayout
from k3verify.serving.parallel.slice_reconcile import cover_size, reconcile_slices, stored_shapes

SUITES = ("full",)
MIS_SLICED = ("the asked layout loaded mis-sliced: every split tensor's slice moved by one row, and where experts are "
              "split, every rank's experts read from the next global id (the wrong experts under its local names)")


def _mis_sliced_session(ctx: CheckContext) -> Session:
    """The session, when its asked layout has something to mis-slice (else the check cannot fail: skipped)."""
    s = session(ctx)
    if not splits_anything(ctx.cfg, ParallelLayout(*s.layout)):
        raise SkipCheck(f"tp={s.layout[0]} ep={s.layout[1]} splits no tensor and no expert of this model "
                        "(no routed experts): every rank loads the whole model, so no load can be mis-sliced")
    return s


def _logits_trial(s: Session, layout: str, control: str) -> Trial:
    ref = {f"rank{r}": s.single["logits"] for r in range(s.world)}
    return Trial(reference=ref, candidate=s.per_rank(f"logits.{layout}"), control=s.per_rank(f"control.{control}"),
                 position_dim=0, metrics=s.metrics(), bar=s.bar,
                 layers=depth_order(s.single["captures"], s.ranks[0][f"captures.{layout}"]),
                 notes=[f"session layout tp={s.layout[0]} ep={s.layout[1]}; every rank's logits are compared "
                        f"(each must end with the whole [T, V]); packed prefill of {s.single['logits'].shape[0]} "
                        "tokens"])


@register_check(
    id="dist.tp.logits", component="serving", level="model", kind=Kind.RMS, bar=DIST_BAR,
    bar_reason=DIST_BAR_REASON, suites=SUITES, devices=("cpu",),
    control="tensor-parallel attention without the all-reduce after o_proj (each rank keeps its partial sum)",
)
def check_tp_logits(ctx: CheckContext) -> Trial:
    return _logits_trial(session(ctx), "tp", "unreduced_attention")


@register_check(
    id="dist.ep.logits", component="serving", level="model", kind=Kind.RMS, bar=DIST_BAR,
    bar_reason=DIST_BAR_REASON, suites=SUITES, devices=("cpu",),
    control="expert ids not offset per rank (every rank treats global ids as its own local ids)",
)
def check_ep_logits(ctx: CheckContext) -> Trial:
    return _logits_trial(session(ctx), "ep", "expert_ids_not_offset")


@register_check(
    id="dist.layout.logits", component="serving", level="model", kind=Kind.RMS, bar=DIST_BAR,
    bar_reason=DIST_BAR_REASON, suites=SUITES, devices=("cpu",),
    control="partial sums all-reduced in bf16 instead of fp32",
)
def check_layout_logits(ctx: CheckContext) -> Trial:
    return _logits_trial(session(ctx), "asked", "bf16_reduce")


def _compared_tokens(s: Session, tokens: list[list[int]], notes: list[str], label: str) -> list[torch.Tensor]:
    """Each prompt's tokens up to a near-tie divergence (then the histories differ and stop being comparable)."""
    rows = []
    for i, (want, got) in enumerate(zip(s.single["greedy"], tokens, strict=True)):
        n = len(want)
        diverge = next((k for k in range(n) if want[k] != got[k]), None)
        if diverge is not None and s.single["gaps"][i][diverge] < TIE_FRACTION:
            n = diverge
            notes.append(f"{label} prompt {i}: near-tie at step {diverge} (top-2 gap "
                         f"{s.single['gaps'][i][diverge]:.3g} of the logit range); compared up to it")
        rows.append(torch.tensor(got[:n]))
    return rows


@register_check(
    id="dist.greedy", component="serving", level="serving", kind=Kind.BITEXACT, suites=SUITES, devices=("cpu",),
    control=MIS_SLICED,
)
def check_greedy(ctx: CheckContext) -> Trial:
    s = _mis_sliced_session(ctx)
    notes: list[str] = []
    ref: dict[str, Any] = {}
    cand: dict[str, Any] = {}
    ctrl: dict[str, Any] = {}
    for layout in ("tp", "ep", "asked"):
        for r, out in enumerate(s.ranks):
            got = _compared_tokens(s, out[f"greedy.{layout}"], notes, f"{layout} rank {r}")
            bad = out["control.shifted_greedy"]
            for i, row in enumerate(got):
                key = f"{layout}.rank{r}.prompt{i}"
                ref[key] = torch.tensor(s.single["greedy"][i][: len(row)])
                cand[key] = row
                ctrl[key] = torch.tensor(bad[i][: len(row)])
    return Trial(reference=ref, candidate=cand, control=ctrl, metrics=s.metrics(),
                 notes=notes + [f"{len(s.single['greedy'])} prompts x {len(s.single['greedy'][0])} greedy steps "
                                "through the runner (packed prefill, paged latent cache, KDA state pool, decode) on "
                                "every rank of the TP-only, EP-only and asked layouts"])


@register_check(
    id="dist.ep.empty_rank", component="serving", level="model", kind=Kind.RMS, bar=DIST_BAR,
    bar_reason=DIST_BAR_REASON, suites=SUITES, devices=("cpu",),
    control="a rank whose experts got no token re-sends its previous layer's partial sum instead of zeros",
)
def check_empty_rank(ctx: CheckContext) -> Trial:
    s = session(ctx)
    if s.single["empty"] is None:
        raise RuntimeError(f"{ctx.cfg.num_experts} experts cannot give each of {s.world} ranks one")
    last = s.ranks[-1]["empty.rows"]
    if last[0] == 0 or any(last[1:]):
        raise RuntimeError(f"the forced routing did not empty the last rank: its rows per MoE layer are {last}")
    calls = torch.tensor([float(out["empty.collectives"]) for out in s.ranks])
    ref = {"logits": s.single["empty"]["logits"], "collectives": torch.full_like(calls, float(calls[0]))}
    cand = {"logits": s.ranks[0]["empty.logits"], "collectives": calls}
    ctrl = {"logits": s.ranks[0]["control.stale_partial"], "collectives": calls}
    metrics = {**s.metrics(), **{f"last_rank_rows.moe{i}": float(n) for i, n in enumerate(last)}}
    return Trial(reference=ref, candidate=cand, control=ctrl, metrics=metrics, bar=s.bar,
                 layers=depth_order(s.single["empty"]["captures"], s.ranks[0]["empty.captures"]),
                 notes=[f"the last rank's experts are unchoosable after the first MoE layer (bias {-1e4:g}), in the "
                        f"single-process reference too; its (token, expert) rows per MoE layer: {last}; every rank "
                        f"issued {int(calls[0])} collectives"])


def _reassemble(s: Session, state_key: str) -> dict[str, tuple[torch.Tensor, int | None]]:
    """Each checkpoint tensor rebuilt from the ranks' loaded slices (rank order along the split dim, which is
    returned too); a tensor held whole is stacked once per rank holding it."""
    pieces: dict[str, list[tuple[int, int | None, torch.Tensor]]] = {}
    for out in s.ranks:
        for name, (source, dim, start, _stop) in out["specs"].items():
            pieces.setdefault(source, []).append((start, dim, out[state_key][name]))
    whole: dict[str, tuple[torch.Tensor, int | None]] = {}
    for source, parts in pieces.items():
        dim = parts[0][1]
        if dim is None:
            whole[source] = (torch.stack([t for _, _, t in parts]), None)
        else:
            whole[source] = (torch.cat([t for _, _, t in sorted(parts, key=lambda p: p[0])], dim=dim), dim)
    return whole


def _expected(ctx: CheckContext, source: str, got: torch.Tensor, dim: int | None, tensors: Any) -> torch.Tensor:
    """The checkpoint tensor as the rebuilt one should be: whole per holding rank, or the split dim's covered
    length (K3's A_log is padded past the heads, and the padding is never loaded)."""
    full = tensors[source].to(got.dtype)
    if dim is None:
        return full.expand(got.shape[0], *full.shape)
    return full.narrow(dim, 0, cover_size(ctx.cfg, source, dim, {source: tuple(full.shape)}))


@register_check(
    id="dist.weights.slices", component="weights", level="module", kind=Kind.BITEXACT, suites=SUITES,
    devices=("cpu",),
    control=MIS_SLICED,
)
def check_slices(ctx: CheckContext) -> Trial:
    s = _mis_sliced_session(ctx)
    built, shifted = _reassemble(s, "state"), _reassemble(s, "control.shifted_state")
    reader = ctx.target.weights()
    ref = {src: _expected(ctx, src, got, dim, reader) for src, (got, dim) in built.items()}
    cand = {src: got for src, (got, _) in built.items()}
    ctrl = {src: got for src, (got, _) in shifted.items()}
    problems = reconcile_slices(ctx.cfg, ParallelLayout(*s.layout), stored_shapes(reader))
    ref["reconcile.problems"] = torch.tensor(0)
    cand["reconcile.problems"] = torch.tensor(len(problems))
    ctrl["reconcile.problems"] = torch.tensor(len(problems))
    return Trial(reference=ref, candidate=cand, control=ctrl, metrics=s.metrics(),
                 notes=[f"{len(cand) - 1} checkpoint tensors rebuilt from {s.world} ranks' loaded slices"]
                 + [f"slice reconcile: {p}" for p in problems[:8]])
