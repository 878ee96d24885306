"""Per-rank memory of a serving configuration, sized on the meta device (nothing is allocated).

Weights: this rank's ParallelServingModel built on meta (the very modules a rank would load), MXFP4 experts
as their packed codes + scales; with `experts="cached"` the bf16 copy the grouped-GEMM path keeps is added.
Caches: PagedLatentCache and KDAStatePool built on meta at this rank's width for `batch` sequences of
`context` tokens. Block-residual buffer: the per-pass [T, blocks, H] buffer. Prefix-cache snapshots: the
budget `serve` gives them (serving/prefix_reuse.py: that many copies of one slot's KDA state and conv windows,
each with a logits row; 0 with the cache off). Transients: plan/transients.py, the worst of one prefill step and
a MoE layer's first call (its experts stacked beside themselves).
Ranks whose shares are the same size are planned once (`ranks` lists them).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from k3verify.config import ModelConfig
from k3verify.plan.transients import Step, expert_stack_bytes, expert_stack_layer_bytes, peak_transient
from k3verify.serving.kv_cache import PagedLatentCache
from k3verify.serving.layers.attn_res import num_blocks
from k3verify.serving.parallel.comm import Comm
from k3verify.serving.parallel.layout import ParallelLayout, check_layout, local_config
from k3verify.serving.parallel.model import ParallelServingModel
from k3verify.serving.prefix_reuse import DEFAULT_SNAPSHOTS
from k3verify.serving.prefix_snapshots import snapshot_bytes
from k3verify.serving.state_cache import KDAStatePool

EXPERT_MODES = ("packed", "cached")
PAGE_SIZE = 16
META = torch.device("meta")


@dataclass(frozen=True)
class PlanRequest:
    tp: int
    ep: int
    context: int  # tokens each sequence holds
    batch: int  # sequences
    segment: int  # new tokens one prefill step runs
    dtype: torch.dtype = torch.bfloat16
    experts: str = "packed"
    page_size: int = PAGE_SIZE
    prefix_snapshots: int = DEFAULT_SNAPSHOTS  # the prefix cache's snapshot budget (0: the cache is off)

    def __post_init__(self) -> None:
        if self.prefix_snapshots < 0:
            raise ValueError(f"prefix_snapshots must be >= 0; got {self.prefix_snapshots}")
        for name in ("context", "batch", "segment", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.segment > self.context:
            raise ValueError(f"segment {self.segment} exceeds context {self.context}: a step cannot run more tokens "
                             "than a sequence holds")
        if self.experts not in EXPERT_MODES:
            raise ValueError(f"experts must be one of {EXPERT_MODES}; got {self.experts!r}")


@dataclass
class RankPlan:
    ranks: list[int]
    weights: int
    expert_bf16_copy: int
    mla_cache: int
    kda_state: int
    block_residual: int
    transient: int
    transient_at: str
    transient_terms: dict[str, int] = field(default_factory=dict)
    prefix_snapshots: int = 0

    @property
    def total(self) -> int:
        return (self.weights + self.expert_bf16_copy + self.mla_cache + self.kda_state + self.block_residual
                + self.transient + self.prefix_snapshots)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def expert_copy_bytes(cfg: ModelConfig, layout: ParallelLayout, dtype: torch.dtype) -> int:
    """The dequantized [E, 2I, D] + [E, D, I] stack the grouped-GEMM path keeps per MoE layer ("cached")."""
    if not cfg.experts_quantized:
        return 0
    per_layer = expert_stack_layer_bytes(cfg, layout, dtype.itemsize)
    return per_layer * sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def plan_rank(cfg: ModelConfig, layout: ParallelLayout, req: PlanRequest) -> RankPlan:
    model = ParallelServingModel(cfg, Comm(layout, planning=True), req.dtype, META)
    weights = _nbytes(model.state_dict().values())
    local = local_config(cfg, layout)
    pages = req.batch * math.ceil(req.context / req.page_size) + 1  # + the scratch page
    mla = _nbytes([PagedLatentCache(local, pages, req.page_size, req.dtype, META).data]) if cfg.has_mla else 0
    pool = KDAStatePool(local, req.batch, META)
    kda = _nbytes(pool.tensors().values()) if cfg.has_kda else 0
    snapshots = req.prefix_snapshots * snapshot_bytes(pool, cfg.vocab_size)
    blocks = req.segment * num_blocks(cfg) * cfg.hidden_size * req.dtype.itemsize if cfg.uses_attn_res else 0
    step = Step(req.segment, req.context, 1, req.dtype.itemsize)
    transient, at, terms = peak_transient(cfg, layout, step)
    stack = expert_stack_bytes(cfg, layout, req.dtype.itemsize, req.experts)
    stacking = {"residual stream": terms["residual stream"], "a MoE layer's experts stacked (its first call)": stack}
    if sum(stacking.values()) > transient:
        transient, at, terms = sum(stacking.values()), "moe (first call)", stacking
    copy = expert_copy_bytes(cfg, layout, req.dtype) if req.experts == "cached" else 0
    return RankPlan([layout.rank], weights, copy, mla, kda, blocks, transient, at, terms, snapshots)


def _signature(cfg: ModelConfig, layout: ParallelLayout) -> tuple[int, ...]:
    counts = (cfg.vocab_size, cfg.kda_num_heads, cfg.num_attention_heads, cfg.intermediate_size,
              cfg.shared_intermediate_size, cfg.expert_in_dim)
    sizes = [b - a for a, b in (layout.tp_range(n) for n in counts)]
    first, stop = layout.ep_range(cfg.num_experts)
    return (*sizes, stop - first)


def plan(cfg: ModelConfig, req: PlanRequest) -> list[RankPlan]:
    """One RankPlan per distinct rank shape (ranks with equal shares share one), largest total first."""
    layout = ParallelLayout(req.tp, req.ep)
    check_layout(cfg, layout)
    by_shape: dict[tuple[int, ...], RankPlan] = {}
    for rank in range(layout.world):
        key = _signature(cfg, layout.at(rank))
        if key in by_shape:
            by_shape[key].ranks.append(rank)
        else:
            by_shape[key] = plan_rank(cfg, layout.at(rank), req)
    return sorted(by_shape.values(), key=lambda p: -p.total)
