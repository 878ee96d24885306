"""The sigmoid router's selection in plain torch: Router.forward's math after the fp32 linear, op for op.

s = sigmoid(logits); choose top-k of s + correction bias (restricted to the best `topk_group` groups,
scored by the sum of their two best biased scores, when groups > topk_group); ids sorted ascending;
weights are the UNcorrected s at those ids, renormalized /(sum + 1e-20) when top_k > 1, x scaling.
"""

from __future__ import annotations

import torch


def route_torch(logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, topk_group: int,
                renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32; bias [E] fp32 -> (weights [T, k] fp32, expert ids [T, k] int64 ascending per row)."""
    scores = torch.sigmoid(logits)
    choice = scores + bias
    if groups > topk_group:
        T, E = choice.shape
        per_group = choice.view(T, groups, E // groups)
        group_score = per_group.topk(min(2, E // groups), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        choice = per_group.masked_fill(~keep[..., None], float("-inf")).view(T, E)
    idx = choice.topk(top_k, dim=-1).indices.sort(dim=-1).values
    weights = scores.gather(1, idx)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, idx
