"""`k3verify bench --context N,..`: one prompt of N tokens prefilled as the serving engine chunks it (its Scheduler
with max_step_tokens = --segment, each chunk through ModelRunner.prefill into one sequence's paged caches), then
decode steps at that context, teacher-forced with the prompt's own next ids.

Per context: prefill tok/s; on CUDA the measured peak against `k3verify plan --context N` for the same segment
(within 10%) and a memory audit per layer kind (MLA, KDA, MoE / dense MLP, the block-residual buffer): the plan's
transient inside each kind against the peak measured inside it, in a second, hooked prefill of the same prompt;
one decode step's time against the bandwidth floor at that context; parity: our bf16 logits at every chunk's last
position and every decoded position against the K3 reference in fp32 streamed one decoder layer at a time
(oracle/streamed.py) over the same ids, run after our model is freed. The bar: DRIFT_FACTOR x the same distance at
the short --parity-base context of the same run (bf16 rounding may not grow with context more than that); the
control, the same logits one row off (each position compared with its neighbour's gold), must fail it.

Every context's planned peak is checked against the card before anything is allocated (plan/device_fit.py).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from k3verify.bench.memory_fit import LazySynthetic
from k3verify.config import ModelConfig
from k3verify.gates import Kind, compare
from k3verify.oracle.streamed import StreamedReference
from k3verify.plan.device_fit import GIB, require_fit
from k3verify.plan.measure import hook_kinds
from k3verify.plan.memory import PlanRequest, RankPlan, plan_rank
from k3verify.plan.transients import Step, kind_totals
from k3verify.serving.layers.attn_res import BlockBuffer
from k3verify.serving.layers.moe import resolve_mxfp4_mode
from k3verify.serving.model import ServingModel
from k3verify.serving.parallel.layout import ParallelLayout
from k3verify.serving.runner import ModelRunner
from k3verify.serving.scheduler import ScheduledSeq, Scheduler

PAGE_SIZE = 64
DRIFT_FACTOR = 2.0
PLAN_TOLERANCE = 0.10
SEQ = 0


@dataclass(frozen=True)
class LongContextPlan:
    preset: str
    contexts: tuple[int, ...]
    segment: int = 8192  # the engine's max_step_tokens: tokens of one prefill chunk
    decode_steps: int = 16
    parity_base: int = 1024  # the short context whose bf16-vs-fp32 distance sets the bar
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.contexts or min(self.contexts) < 2:
            raise ValueError(f"contexts must be tokens >= 2; got {self.contexts}")
        if self.segment < 1 or self.decode_steps < 1 or self.parity_base < 2:
            raise ValueError(f"segment, decode_steps must be >= 1 and parity_base >= 2; got {self.segment}, "
                             f"{self.decode_steps}, {self.parity_base}")
        if self.parity_base >= min(self.contexts):
            raise ValueError(f"parity_base {self.parity_base} must be shorter than every context {self.contexts}")


@dataclass
class LongContextResult:
    preset: str
    device: str
    segment: int
    copy_bandwidth_bytes_s: float | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r["parity"]["status"] in ("pass", "base") and r.get("plan_within_10pct", True) for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "long_context", "preset": self.preset, "device": self.device, "segment": self.segment,
                "copy_bandwidth_bytes_s": self.copy_bandwidth_bytes_s, "rows": self.rows, "notes": self.notes,
                "passed": self.passed}


def planned(cfg: ModelConfig, context: int, plan: LongContextPlan, device: torch.device) -> RankPlan:
    """`k3verify plan --context N --segment S` for this run's sequence (its decoded tokens included, no prefix
    cache), with the expert mode our model will take on `device`."""
    mode = resolve_mxfp4_mode("auto", cfg.experts_quantized, torch.bfloat16, device)
    return plan_rank(cfg, ParallelLayout(1, 1), PlanRequest(
        1, 1, context + plan.decode_steps + 1, 1, min(plan.segment, context), torch.bfloat16,
        "cached" if mode == "cached" else "packed", PAGE_SIZE, prefix_snapshots=0))


def require_long_context_fits(cfg: ModelConfig, plan: LongContextPlan, device: torch.device,
                              card_gib: float) -> None:
    """DoesNotFit "bench --context N ... needs X GiB, this card has Y GiB; try ..." when the longest context does
    not fit (caches and transients only grow with the context: it holds every shorter one's peak)."""
    context = max(plan.contexts)
    need = planned(cfg, context, plan, device).total
    require_fit(f"bench --context {context} (plan: weights, caches, one {min(plan.segment, context)}-token prefill "
                "step)", need, card_gib, "a shorter --context or --segment, or a card with more memory")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_prefill(runner: ModelRunner, ids: list[int], segment: int, extra: int,
                   on_chunk: Callable[[], None] = lambda: None) -> dict[int, torch.Tensor]:
    """Prefill `ids` as one sequence the way the engine chunks it (Scheduler, max_step_tokens=segment), with room
    for `extra` decoded tokens; {chunk's last position: its logits [V]}; the sequence stays admitted."""
    scheduler = Scheduler(runner, max_step_tokens=segment)
    seq = ScheduledSeq(SEQ, ids, max_new_tokens=extra)
    scheduler.add(seq)
    out: dict[int, torch.Tensor] = {}
    while not seq.is_prefilled:
        step = scheduler.schedule()
        for chunk in step.prefill:
            on_chunk()
            out[chunk.end - 1] = runner.prefill([(SEQ, chunk.tokens)])[0]
    return out


def _block_bytes(model: ServingModel, seen: list[int]) -> Callable[[], None]:
    """Record the bytes of every block-residual buffer the model allocates; returns the undo."""
    new_blocks = model._new_blocks
    patched: Any = model  # the method is shadowed by an instance attribute, removed again by the undo

    def recording(x: torch.Tensor, ctx: Any) -> Any:
        blocks = new_blocks(x, ctx)
        if isinstance(blocks, BlockBuffer):
            seen.append(blocks.data.numel() * blocks.data.element_size())
        return blocks
    patched._new_blocks = recording
    return lambda: delattr(model, "_new_blocks")


def memory_audit(runner: ModelRunner, cfg: ModelConfig, ids: list[int], segment: int,
                 plan: RankPlan) -> list[dict[str, Any]]:
    """CUDA: the peak inside each layer kind (over its own start) and the block-residual buffer, in a prefill of
    `ids` with hooks, against the plan's transient for that kind."""
    measured: dict[str, int] = {}
    handles = hook_kinds(runner.model, cfg, measured)
    blocks: list[int] = []
    undo = _block_bytes(runner.model, blocks)
    try:
        engine_prefill(runner, ids, segment, 1)
    finally:
        undo()
        for h in handles:
            h.remove()
        runner.release(SEQ)
    predicted = kind_totals(cfg, ParallelLayout(1, 1), Step(segment, len(ids), 1, torch.bfloat16.itemsize))
    if cfg.uses_attn_res:
        predicted["block_residual"], measured["block_residual"] = plan.block_residual, max(blocks, default=0)
    return [{"kind": k, "predicted_bytes": p, "measured_bytes": measured.get(k, 0),
             "predicted_over_measured": p / measured[k] if measured.get(k) else None} for k, p in predicted.items()]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def ours(cfg: ModelConfig, plan: LongContextPlan, ids: list[int], context: int, device: torch.device,
         row: dict[str, Any]) -> tuple[list[int], torch.Tensor]:
    """Our bf16 model over ids[:context] (engine-chunked prefill), then decode_steps teacher-forced steps: fills
    `row` with speeds and memory; (positions, their logits [P, V] in fp32 on the CPU)."""
    segment = min(plan.segment, context)
    model = ServingModel(cfg, torch.bfloat16, device).load(LazySynthetic(cfg, plan.seed, device))
    runner = ModelRunner(model, num_pages=math.ceil((context + plan.decode_steps + 1) / PAGE_SIZE) + 1,
                         page_size=PAGE_SIZE, num_slots=1, max_context=context + plan.decode_steps + 1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    kept = engine_prefill(runner, ids[:context], segment, plan.decode_steps + 1)
    _sync(device)
    seconds = time.perf_counter() - start
    row.update(segment=segment, prefill_chunks=len(kept), prefill_s=seconds, prefill_tok_s=context / seconds)
    if device.type == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
    steps = []
    for t in range(context, context + plan.decode_steps):
        _sync(device)
        t0 = time.perf_counter()
        kept[t] = runner.decode([(SEQ, ids[t])])[0]
        _sync(device)
        steps.append(time.perf_counter() - t0)
    row["decode_step_s"] = statistics.median(steps)
    runner.release(SEQ)
    if device.type == "cuda":
        row["memory_audit"] = memory_audit(runner, cfg, ids[:context], segment, planned(cfg, context, plan, device))
    positions = sorted(kept)
    logits = torch.stack([kept[p].float().cpu() for p in positions])
    del runner, model, kept
    _free(device)
    return positions, logits


def streamed_gold(cfg: ModelConfig, plan: LongContextPlan, ids: list[int], positions: list[int],
                  device: torch.device) -> tuple[torch.Tensor, str]:
    """The K3 reference in fp32, streamed one decoder layer at a time, over ids[:positions[-1] + 1]: its logits at
    `positions` [P, V] (fp32, CPU) and what it held."""
    ref = StreamedReference(cfg, LazySynthetic(cfg, plan.seed, device), torch.float32, device)
    out = ref(torch.tensor(ids[:positions[-1] + 1]), positions=torch.tensor(positions)).logits.float().cpu()
    _free(device)
    return out, ref.stats.describe()


def parity_row(ours_logits: torch.Tensor, gold: torch.Tensor, bar: float | None) -> dict[str, Any]:
    """rel RMS of ours vs the gold (bar None: the base row, whose distance sets the others' bar), with the
    control (ours one row off) that must fail it."""
    cand = compare(Kind.RMS, gold, ours_logits, 1.0).metric
    ctrl = compare(Kind.RMS, gold, torch.roll(ours_logits, 1, dims=0), 1.0).metric
    if bar is None:
        status = "base"
    else:
        status = "pass" if cand <= bar and ctrl > bar else ("vacuous" if ctrl <= bar else "fail")
    return {"metric": cand, "bar": bar, "control_metric": ctrl, "status": status,
            "argmax_agreement": float((ours_logits.argmax(-1) == gold.argmax(-1)).float().mean())}


def run_long_context(plan: LongContextPlan, cfg: ModelConfig, device: torch.device, card_gib: float | None,
                     bandwidth: float | None, progress: Callable[[str], None] = lambda s: None) -> LongContextResult:
    if card_gib is not None:
        require_long_context_fits(cfg, plan, device, card_gib)
    result = LongContextResult(plan.preset, torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                               plan.segment, bandwidth)
    if device.type != "cuda":
        result.notes.append("peak memory, the plan comparison and the memory audit per layer kind are CUDA-only; "
                            "on the CPU only the logic and parity are checked (speeds are not meaningful)")
    base: float | None = None
    for context in (plan.parity_base, *sorted(plan.contexts)):
        g = torch.Generator().manual_seed(plan.seed * 1_000_003 + context)
        ids = torch.randint(0, cfg.vocab_size, (context + plan.decode_steps,), generator=g).tolist()
        row: dict[str, Any] = {"context": context, "base": context == plan.parity_base}
        progress(f"context {context}: our bf16 model, engine-chunked prefill and {plan.decode_steps} decode steps")
        positions, logits = ours(cfg, plan, ids, context, device, row)
        if device.type == "cuda":
            want = planned(cfg, context, plan, device).total
            row.update(planned_bytes=want, plan_diff_pct=100 * (want / row["peak_bytes"] - 1),
                       plan_within_10pct=abs(want / row["peak_bytes"] - 1) <= PLAN_TOLERANCE)
        if bandwidth is not None:
            from k3verify.bench.floor import decode_floor_bytes

            row["floor_s"] = decode_floor_bytes(cfg, 1, context).total / bandwidth
            row["floor_fraction"] = row["floor_s"] / row["decode_step_s"]
        progress(f"context {context}: the fp32 gold, streamed one decoder layer at a time")
        gold, held = streamed_gold(cfg, plan, ids, positions, device)
        row["gold"] = held
        row["parity"] = parity_row(logits, gold, None if base is None else DRIFT_FACTOR * base)
        row["parity"]["positions"] = len(positions)
        if base is None:
            base = row["parity"]["metric"]
        result.rows.append(row)
    return result


def table(result: dict[str, Any]) -> str:
    out = [f"long context, {result['preset']} on {result['device']}, prefill chunks of {result['segment']} tokens",
           "| context | prefill tok/s | peak GiB | plan GiB (diff) | decode ms | of floor | parity rel RMS (bar) |",
           "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        peak = f"{r['peak_bytes'] / GIB:.2f}" if "peak_bytes" in r else "-"
        plan = f"{r['planned_bytes'] / GIB:.2f} ({r['plan_diff_pct']:+.1f}%)" if "planned_bytes" in r else "-"
        floor = f"{r['floor_fraction']:.0%}" if "floor_fraction" in r else "-"
        p = r["parity"]
        par = (f"{p['metric']:.3g} (base: sets the bar)" if p["bar"] is None else
               f"{p['metric']:.3g} ({p['bar']:.3g}, control {p['control_metric']:.3g}) {p['status']}")
        out.append(f"| {r['context']:,} | {r['prefill_tok_s']:,.0f} | {peak} | {plan} | "
                   f"{r['decode_step_s'] * 1e3:.3f} | {floor} | {par} |")
    audits = [r for r in result["rows"] if "memory_audit" in r]
    if not audits:
        out.append("memory audit per layer kind: CUDA-only (this run is on the CPU)")
    for r in audits:
        out += [f"memory audit at {r['context']:,} (transient inside each layer kind; block residual: its buffer)",
                "| kind | predicted GiB | measured GiB | predicted/measured |", "|---|---|---|---|"]
        for a in r["memory_audit"]:
            ratio = "-" if a["predicted_over_measured"] is None else f"{a['predicted_over_measured']:.3f}"
            out.append(f"| {a['kind']} | {a['predicted_bytes'] / GIB:.3f} | {a['measured_bytes'] / GIB:.3f} | "
                       f"{ratio} |")
    out += [f"note: {n}" for n in result["notes"]]
    return "\n".join(out)
