"""The MoE block split over ranks: routed experts by expert id (EP), shared experts and the LatentMoE
projections by columns (TP).

Every rank sees every token and runs the full router (same fp32 logits, same top-k, so every rank agrees on
every token's experts). Dispatch is the selection of the (token, expert) pairs whose expert this rank owns;
those rows go through the rank's experts in one combine call (the single-process combine, k = 1 per pair)
and land in an fp32 [T, D] partial sum; the partial sums are all-reduced in fp32. A rank whose experts no
token chose still all-reduces its zeros: every collective is issued by every rank, in the same order.

LatentMoE under TP: routed_expert_down_proj is column-parallel (each rank computes its latent columns, an
all-gather makes the latent whole for the experts), routed_expert_norm runs on the whole combined latent
(so the routed all-reduce must come before it), routed_expert_up_proj is row-parallel and its partial sum
joins the shared experts' partial sum in one all-reduce.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from k3verify.config import ModelConfig
from k3verify.kernels.moe import moe_combine
from k3verify.kernels.moe.grouped import moe_packed_combine
from k3verify.serving.layers.linear import linear
from k3verify.serving.layers.mlp import GatedMLP
from k3verify.serving.layers.moe import Router, SparseMoE
from k3verify.serving.parallel.comm import Comm
from k3verify.serving.parallel.layout import split_range


class ParallelMoE(SparseMoE):
    """SparseMoE holding experts [first_expert, first_expert + num_experts) of this rank (module names
    `experts.{local id}`), the global router, and this rank's share of the shared experts."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str | None, mxfp4_mode: str,
                 tile_tokens: int | None, comm: Comm) -> None:
        layout = comm.layout
        first, stop = layout.ep_range(cfg.num_experts)
        super().__init__(replace(cfg, num_experts=stop - first), dtype, device, mxfp4_mode, tile_tokens)
        H = cfg.hidden_size
        self.comm, self.first_expert = comm, first
        self.split_experts, self.split_columns = layout.ep > 1, layout.tp > 1
        self.gate = Router(cfg, device)
        self.rows_routed = 0  # (token, expert) pairs this rank ran in its last forward
        if self.split_columns:
            lo, hi = layout.tp_range(cfg.shared_intermediate_size)
            self.shared_experts = GatedMLP(cfg, H, hi - lo, dtype, device, tile_tokens)
            if self.latent:
                L = cfg.expert_in_dim
                self.latent_sizes = [b - a for a, b in (split_range(L, layout.tp, r) for r in range(layout.tp))]
                lo, hi = layout.tp_range(L)
                self.latent_cols = (lo, hi)
                self.routed_expert_down_proj = linear(H, hi - lo, dtype, device)
                self.routed_expert_up_proj = linear(hi - lo, H, dtype, device)

    def routed_partial(self, x_in: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """sum over this rank's experts of w_k expert_k(x_in), fp32 [T, D]; zeros where it owns none."""
        local = idx - self.first_expert
        mine = (local >= 0) & (local < self.num_experts)
        pairs = mine.nonzero()  # [P, 2] (token, pick), token-major: each token's picks in ascending id order
        self.rows_routed = int(pairs.shape[0])
        out = torch.zeros(x_in.shape, dtype=torch.float32, device=x_in.device)
        if self.rows_routed == 0:
            return out
        tokens = pairs[:, 0]
        rows, w, ids = x_in.index_select(0, tokens), weights[mine][:, None], local[mine][:, None]
        if self.is_packed:
            terms = moe_packed_combine(rows, self.packed_experts(), w, ids, self.act)
        else:
            terms = moe_combine(self, rows, w, ids)
        return out.index_add_(0, tokens, terms)

    def _latent_in(self, x: torch.Tensor) -> torch.Tensor:
        x_lat = self.routed_expert_down_proj(x)
        return self.comm.all_gather(x_lat, self.latent_sizes, dim=-1) if self.split_columns else x_lat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)
        x_in = self._latent_in(x) if self.latent else x
        routed = self.routed_partial(x_in, weights, idx)
        if self.latent:
            if self.split_experts:
                routed = self.comm.all_reduce(routed)
            y = routed.to(x.dtype)
            if hasattr(self, "routed_expert_norm"):
                y = self.routed_expert_norm(y)
            if not self.split_columns:
                return self.routed_expert_up_proj(y) + self.shared_experts(x)
            lo, hi = self.latent_cols
            up = F.linear(y[:, lo:hi], self.routed_expert_up_proj.weight)
            return self.comm.all_reduce(up.float() + self.shared_experts(x).float()).to(x.dtype)
        if self.split_experts and self.split_columns:  # one collective for both partial sums
            return self.comm.all_reduce(routed + self.shared_experts(x).float()).to(x.dtype)
        if self.split_experts:
            return self.comm.all_reduce(routed).to(x.dtype) + self.shared_experts(x)
        if self.split_columns:
            return routed.to(x.dtype) + self.comm.all_reduce(self.shared_experts(x))
        return routed.to(x.dtype) + self.shared_experts(x)
