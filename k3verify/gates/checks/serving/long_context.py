"""Long context through the served path: the shared long prompt (gates/shared/long_context.py, ~4,000 tokens) prefilled
in segments over paged caches of 16-token pages (past 64 pages), the last tokens decoded one at a time, every
position's logits held to the one cached fp32 oracle run.

Segments: LONG_SEGMENTS tokens each (the first one past the attention's 1,024-row query block, the others
continuing over a cached prefix), the rest of the prompt in one more segment but for DECODE_TAIL tokens fed one
by one by the decode step (teacher-forced with the prompt's own ids, so no second oracle run is needed).
Control: logical pages past 64 wrap onto the first 64 (a page index taken modulo 64), on the first
CONTROL_TOKENS tokens only (80 pages): the fault writes over keys earlier tokens still read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3verify.gates import CheckContext, Kind, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.long_context import long_gold, long_oracle, long_prompt
from k3verify.gates.shared.route_pin import PinStats, RouteRecord, pin_routes
from k3verify.serving.batch import PackedBatch
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner

PAGE_SIZE = 16
LONG_SEGMENTS = (1536, 1024, 1024)
DECODE_TAIL = 8
CONTROL_TOKENS = 1280
WRAP_PAGES = 64
PageTables = Callable[[list[int]], list[int]]


def served_logits(model: ServingModel, ids: list[int], segments: list[int], decode_tail: int,
                  page_table: PageTables = list) -> torch.Tensor:
    """Every position's logits [T, V] of one sequence served in prefill segments of `segments` tokens, then
    `decode_tail` decode steps; `page_table` maps the sequence's page table to the one the prefills use."""
    if sum(segments) + decode_tail != len(ids):
        raise ValueError(f"segments {segments} + {decode_tail} decoded tokens != {len(ids)} prompt tokens")
    runner = ModelRunner(model, num_pages=len(ids) // PAGE_SIZE + 2, page_size=PAGE_SIZE, num_slots=1,
                         max_context=len(ids))
    runner.admit(0, len(ids))
    rows, pos = [], 0
    try:
        for n in segments:
            batch = PackedBatch.build(torch.tensor(ids[pos:pos + n]), [n], start_pos=[pos], slots=[runner.slot_of(0)],
                                      page_tables=[page_table(runner.kv_cache.table(0))], page_size=PAGE_SIZE,
                                      device=model.device, stage=runner.staging.to_device)
            out = model.prefill(batch, all_logits=True)
            assert out.all_logits is not None
            rows.append(out.all_logits.float())
            runner.mark_cached(0, n)
            pos += n
        for t in range(pos, len(ids)):
            rows.append(runner.decode([(0, ids[t])]).float())
    finally:
        runner.release(0)
    return torch.cat(rows)


def wrapped_pages(table: list[int]) -> list[int]:
    """The control's fault: logical page i past WRAP_PAGES lands on the physical page of i mod WRAP_PAGES."""
    return [table[i % WRAP_PAGES] for i in range(len(table))]


def max_expert_load(routes: RouteRecord, segments: list[int]) -> int:
    """The most tokens one expert received in one prefill segment, over every MoE layer (from the oracle's choices,
    which the served routers follow up to pinned near-ties)."""
    most = 0
    for layer in routes.calls:
        _, _, idx = routes.layer(layer)
        start = 0
        for n in segments:
            most = max(most, int(torch.bincount(idx[start:start + n].flatten().cpu()).max()))
            start += n
    return most


@register_check(
    id="serving.long_context.logits", component="serving", level="serving", kind=Kind.RMS, suites=("full",),
    noise="the K3 reference's logits over the long prompt in fp32 vs fp64 (routes pinned)",
    control=f"logical pages past {WRAP_PAGES} wrap onto the first {WRAP_PAGES} (a page index modulo {WRAP_PAGES})",
)
@builders.single_thread
def check_long_context_logits(ctx: CheckContext) -> Trial:
    ids = long_prompt(ctx).tolist()
    T = len(ids)
    segments = list(LONG_SEGMENTS)
    while sum(segments) + DECODE_TAIL > T:
        segments.pop()
    segments.append(T - DECODE_TAIL - sum(segments))
    ref, routes = long_oracle(ctx)
    model, oracle = builders.serving_model(ctx), builders.reference_model(ctx)
    stats = PinStats()
    with pin_routes(model, routes, oracle, ctx.cfg, stats):
        cand = served_logits(model, ids, segments, DECODE_TAIL)
    ctrl_segments = [1024, CONTROL_TOKENS - 1024]
    with pin_routes(model, routes, oracle, ctx.cfg, PinStats()):
        ctrl = served_logits(model, ids[:CONTROL_TOKENS], ctrl_segments, 0, wrapped_pages)
    gold = long_gold(ctx) if ctx.needs_noise else None
    metrics = {"tokens": float(T), "pages": float(-(-T // PAGE_SIZE)), "prefill_segments": float(len(segments)),
               "max_tokens_one_expert_one_segment": float(max_expert_load(routes, segments)) if routes.calls else 0.0,
               **stats.as_metrics()}
    return Trial(reference=ref.logits.float(), candidate=cand, control=torch.cat([ctrl, cand[CONTROL_TOKENS:]]),
                 noise=None if gold is None else (ref.logits, gold), position_dim=0, metrics=metrics,
                 notes=[f"one prompt of {T} tokens, {-(-T // PAGE_SIZE)} pages of {PAGE_SIZE}: prefill segments "
                        f"{segments}, then {DECODE_TAIL} decode steps; serving model fp32 vs the fp32 oracle",
                        f"control: the first {CONTROL_TOKENS} tokens in segments {ctrl_segments} with pages past "
                        f"{WRAP_PAGES} wrapped",
                        f"router near-ties pinned: {stats.pinned} of {stats.flips} flipped token choices"])
