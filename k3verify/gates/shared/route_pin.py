"""Router boundary handling for whole-model comparisons.

Top-k routing is discontinuous: a 1e-7 drift flips the expert choice of a token whose k-th and
(k+1)-th scores nearly tie, and the flip then grows with depth. Two correct stacks can therefore
differ at model level. Here a candidate's routing is pinned to the reference's choice ONLY for
tokens whose flip is explained by drift: the reference's boundary gap is within twice the largest
score difference the candidate sees for that token, and that difference is small in absolute terms
(a wrong router has large differences and is never pinned). Every pin is counted and its gap
reported, so a near-tie is told apart from a bug.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from k3verify.config import ModelConfig

MAX_DRIFT = 1e-2  # |choice-score drift| fp32 noise can reach deep in a model; a router bug (e.g. a dropped
# correction bias, |bias| ~ 0.1) sits far above it


@dataclass
class RouteRecord:
    """Per MoE layer: router inputs and decisions of every call, in call order."""

    calls: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xs, ws, ids = zip(*self.calls[i], strict=True)
        return torch.cat(xs), torch.cat(ws), torch.cat(ids)


@dataclass
class PinStats:
    flips: int = 0  # tokens whose expert set differed
    pinned: int = 0  # of those, explained by drift and pinned to the reference choice
    min_gap: float = float("inf")  # smallest reference boundary gap among pinned tokens
    max_drift: float = 0.0  # largest choice-score difference among pinned tokens

    def as_metrics(self, prefix: str = "router") -> dict[str, float]:
        out = {f"{prefix}.flips": float(self.flips), f"{prefix}.pinned": float(self.pinned)}
        if self.pinned:
            out[f"{prefix}.min_pinned_gap"] = self.min_gap
            out[f"{prefix}.max_pinned_drift"] = self.max_drift
        return out


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """`model.model.layers` of either stack (serving model or a reference), in order."""
    return list(model.get_submodule("model.layers").children())


def tensor_attr(module: nn.Module, name: str) -> torch.Tensor:
    """A parameter or buffer of `module` by name; a TypeError naming it if it is something else."""
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name} is {type(value).__name__}, not a tensor")
    return value


def choice_scores(gate: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x W^T) + correction bias in fp32 (the quantity top-k ranks)."""
    weight = tensor_attr(gate, "weight")
    w = weight.float() if x.dtype != torch.float64 else weight.double()
    logits = (x.float() if x.dtype != torch.float64 else x) @ w.t()
    return torch.sigmoid(logits) + tensor_attr(gate, "e_score_correction_bias").to(logits.dtype)


def boundary_gap(choice: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[T] distance of each token from a different decision (k-th vs k+1-th expert, and for grouped
    routing the topk_group-th vs next group)."""
    T, E = choice.shape
    k = cfg.num_experts_per_token
    gaps = []
    if cfg.num_expert_group > cfg.topk_group:
        G = cfg.num_expert_group
        per_group = choice.view(T, G, E // G)
        group_score = per_group.topk(min(2, E // G), dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
        gaps.append(group_score[:, cfg.topk_group - 1] - group_score[:, cfg.topk_group])
        keep = torch.zeros(T, G, dtype=torch.bool, device=choice.device)
        keep.scatter_(1, per_group.topk(min(2, E // G), dim=-1).values.sum(-1).topk(cfg.topk_group).indices, True)
        choice = per_group.masked_fill(~keep[..., None], float("-inf")).view(T, E)
    if k < E:
        top = choice.topk(k + 1, dim=-1).values
        gaps.append(top[:, k - 1] - top[:, k])
    if not gaps:
        return torch.full((T,), float("inf"), device=choice.device)
    return torch.stack(gaps).amin(dim=0)


@contextlib.contextmanager
def record_routes(model: nn.Module) -> Iterator[RouteRecord]:
    """Record (x, weights, idx) of every `block_sparse_moe.gate` call of `model` (either stack)."""
    record = RouteRecord()
    handles = []
    for i, layer in enumerate(decoder_layers(model)):
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None:
            continue

        def hook(_m: nn.Module, inputs: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, torch.Tensor],
                 i: int = i) -> None:
            record.calls.setdefault(i, []).append((inputs[0].detach(), out[0].detach(), out[1].detach()))
        handles.append(moe.gate.register_forward_hook(hook))
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # a gate's forward: x -> (weights, ids)


@contextlib.contextmanager
def pin_routes(model: nn.Module, reference: RouteRecord, ref_model: nn.Module, cfg: ModelConfig,
               stats: PinStats) -> Iterator[None]:
    """While active, each serving router call whose tokens line up with the reference record pins
    drift-explained flips to the reference decision (see module doc). Calls are matched in order."""
    cursors: dict[int, int] = {}
    originals = []
    ref_layers = decoder_layers(ref_model)
    for i, layer in enumerate(decoder_layers(model)):
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None or i not in reference.calls:
            continue
        gate, ref_gate = moe.gate, ref_layers[i].get_submodule("block_sparse_moe.gate")
        plain = gate.forward

        def pinned(x: torch.Tensor, i: int = i, gate: nn.Module = gate, ref_gate: nn.Module = ref_gate,
                   plain: Router = plain) -> tuple[torch.Tensor, torch.Tensor]:
            weights, idx = plain(x)
            rx, rw, ridx = reference.layer(i)
            start = cursors.get(i, 0)
            cursors[i] = start + x.shape[0]
            rx, rw, ridx = rx[start:start + x.shape[0]], rw[start:start + x.shape[0]], ridx[start:start + x.shape[0]]
            if rx.shape[0] != x.shape[0]:
                return weights, idx
            differ = (idx != ridx.to(idx.device)).any(dim=-1)
            if not differ.any():
                return weights, idx
            drift = (choice_scores(gate, x) - choice_scores(ref_gate, rx).to(x.device)).abs().amax(dim=-1)
            gap = boundary_gap(choice_scores(ref_gate, rx), cfg).to(x.device)
            explained = differ & (gap <= 2 * drift) & (drift <= MAX_DRIFT)
            stats.flips += int(differ.sum())
            stats.pinned += int(explained.sum())
            if explained.any():
                stats.min_gap = min(stats.min_gap, float(gap[explained].min()))
                stats.max_drift = max(stats.max_drift, float(drift[explained].max()))
                weights = torch.where(explained[:, None], rw.to(weights), weights)
                idx = torch.where(explained[:, None], ridx.to(idx), idx)
            return weights, idx
        gate.forward = pinned
        originals.append(gate)
    try:
        yield
    finally:
        for gate in originals:
            del gate.forward
