"""The speculative bench's parity, run before any speed: teacher-forced score logits against the fp32 gold,
the fused KDA score against the unfused one bit for bit (rows 1/4/8, eager and graph replay), and the captured
score step against the same step eager. Each is a bench trial judged like the parity checks
(bench.speed_parity.judge)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from k3verify.bench.speed_parity import judge, judge_vs_gold
from k3verify.config import ModelConfig
from k3verify.gates import Kind, Trial
from k3verify.serving.spec.score_graphs import ScoreGraphs
from k3verify.serving.spec.scorer import SpecScorer


def score_logits_parity(scorer: SpecScorer, graphs: ScoreGraphs | None, ids: torch.Tensor, gold: torch.Tensor,
                         theirs: torch.Tensor, chunks: int, bar: float) -> dict[str, Any]:
    """Prefill ids[:P], then `chunks` score packs of k+1 teacher-forced ids, each committed whole; the prefill's
    last logits and every score position's against the fp32 gold at those positions. Bar: max(bar, 1.5 x the
    bf16 baseline's own distance there), as the decode parity. Control: each pack commits only its first token
    while the next pack still starts k+1 tokens later (the accepted-prefix bookkeeping broken)."""
    runner, n = scorer.runner, scorer.num_positions
    P = ids.numel() - chunks * n

    def run(commit_all: bool) -> torch.Tensor:
        sid = max(runner.active_ids, default=-1) + 1
        runner.admit(sid, P + chunks * n + n)
        try:
            rows = [runner.prefill([(sid, ids[:P].tolist())])]
            for c in range(chunks):
                rows.append(scorer.score([(sid, ids[P + c * n:P + (c + 1) * n].tolist())], graphs)[0].clone())
                scorer.commit([scorer.num_draft if commit_all else 0])
            return torch.cat(rows)
        finally:
            runner.release(sid)

    cand, ctrl = run(True), run(False)
    end = P + chunks * n
    return judge_vs_gold("bench.spec_verify_logits_vs_fp32_gold", gold[P - 1:end], theirs[P - 1:end], cand, ctrl,
                         bar, f"prefill {P}, then {chunks} score packs of {n} teacher-forced tokens (fused KDA "
                         f"score: {scorer.fused})")


def fused_kernel_parity(cfg: ModelConfig, device: torch.device, rows: tuple[int, ...], seed: int) -> dict[str, Any]:
    """spec.fused.vs_unfused at this model's KDA dims (CUDA): same trial, judged here."""
    from k3verify.gates.shared.spec_score import fused_vs_unfused_trial

    ctx = SimpleNamespace(cfg=cfg, device=device, generator=torch.Generator().manual_seed(seed))
    return judge("bench.kda_fused_verify_vs_unfused", Kind.BITEXACT, fused_vs_unfused_trial(ctx, rows))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def score_graph_parity(scorer: SpecScorer, graphs: ScoreGraphs, prompts: torch.Tensor) -> dict[str, Any]:
    """One score pack through the captured graph vs the same static step eagerly, from the same caches: logits
    and records bit for bit. Control: the graph replayed while its static inputs still hold another pack (the
    refill skipped).

    Both runs get one set of inputs (slots, page tables, cached counts) read once after the prefill, and the
    caches restored from one snapshot; nothing is committed, so the runner's host-side counts never move. (A
    score + commit between the runs advanced those counts: the replay then scored one position later than
    the eager step, which matched the KDA records up to the first MLA layer and nothing after it.)"""
    runner, n, arena = scorer.runner, scorer.num_positions, scorer.arena
    eager = scorer.make_graphs(graphs.max_context, graphs.buckets, use_graphs=False)
    B = prompts.shape[0]
    base = max(runner.active_ids, default=-1) + 1
    ids = list(range(base, base + B))
    for sid, p in zip(ids, prompts.tolist(), strict=True):
        runner.admit(sid, len(p) + n)
    pool, kv = runner.state_pool.tensors(), runner.kv_cache

    def outputs(logits: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": _bits(logits.float().clone()), "records": _bits(arena.state[:, :B].clone())}

    def restore() -> None:
        for k, v in snap[0].items():
            pool[k].copy_(v)
        kv.data.copy_(snap[1])

    def run(steps: ScoreGraphs, shift: int) -> dict[str, torch.Tensor]:
        restore()
        flat = [(7 * sid + 3 * j + shift) % 1000 + 1 for sid in ids for j in range(n)]
        logits, _, _ = steps.score(flat, slots, tables, starts)
        return outputs(logits)

    try:
        runner.prefill(list(zip(ids, prompts.tolist(), strict=True)))
        slots, tables = [runner.slot_of(sid) for sid in ids], [runner.kv_cache.table(sid) for sid in ids]
        starts = [runner.num_cached(sid) for sid in ids]
        snap = ({k: v.clone() for k, v in pool.items()}, kv.data.clone())
        ref, cand = run(eager, 0), run(graphs, 0)
        run(graphs, 1)  # leaves the other pack in the graph's static inputs
        restore()
        ctrl = outputs(graphs.replay_stale(B))  # the control's fault: no refill
    finally:
        for sid in ids:
            runner.release(sid)
    trial = Trial(reference=ref, candidate=cand, control=ctrl,
                  notes=[f"{B} rows x {n} positions from {starts[0]} cached tokens; captures={graphs.captures}"])
    return judge(f"bench.verify_graph_vs_eager.b{B}", Kind.BITEXACT, trial)
