"""Router, routed experts (dense or MXFP4) and the MoE / LatentMoE block.

Router (fp32): s = sigmoid(x W^T); choose top-k of s + correction bias (grouped when groups >
topk_group); weights are the uncorrected s at the chosen experts, renormalized, x scaling factor.
Block: y = sum_k w_k expert_k(x_in) accumulated in fp32, cast back, + shared(x). LatentMoE (K3):
x_in = routed_expert_down_proj(x) once per token, experts run in the latent, routed_expert_norm once
after the combine, then routed_expert_up_proj; shared experts stay in hidden space.

MXFP4 experts (`mxfp4_mode`): "cached" dequantizes every expert to the activation dtype once and keeps
it (the reference path: 4x the checkpoint's expert bytes on top of the packed buffers), "per_use"
dequantizes at each use, "packed" keeps only the checkpoint's codes and scales, stacked per layer,
and runs both expert GEMMs on them (kernels/mxfp4.grouped_mm: Triton on CUDA). "auto" (ServingModel's
default) is "packed" for bf16 on CUDA, else "cached".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3verify.config import ModelConfig
from k3verify.kernels.moe import moe_combine
from k3verify.kernels.moe.decode_launch import GluSpec
from k3verify.kernels.moe.grouped import PackedExperts, moe_packed_combine
from k3verify.kernels.mxfp4 import dequantize
from k3verify.kernels.router import route
from k3verify.serving.layers.linear import linear
from k3verify.serving.layers.mlp import GatedMLP, glu_activation
from k3verify.serving.layers.norm import RMSNorm

MXFP4_MODES = ("cached", "per_use", "packed")


def resolve_mxfp4_mode(mode: str, quantized: bool, dtype: torch.dtype, device: torch.device) -> str:
    """Resolve "auto": "packed" where the Triton kernel serves it (bf16 on CUDA, quantized experts), else
    "cached". Any other value must be one of MXFP4_MODES."""
    if mode == "auto":
        return "packed" if quantized and device.type == "cuda" and dtype == torch.bfloat16 else "cached"
    if mode not in MXFP4_MODES:
        raise ValueError(f"mxfp4_mode must be 'auto' or one of {MXFP4_MODES}; got {mode!r}")
    return mode


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        E = cfg.num_experts
        self.weight = nn.Parameter(torch.zeros(E, cfg.hidden_size, dtype=torch.float32, device=device),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32, device=device),
                                                    requires_grad=False)
        self.top_k, self.groups, self.topk_group = cfg.num_experts_per_token, cfg.num_expert_group, cfg.topk_group
        self.renormalize, self.scaling = cfg.moe_renormalize, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k] int64 ascending per token)."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        return route(logits, self.e_score_correction_bias.float(), self.top_k, self.groups, self.topk_group,
                     self.renormalize, self.scaling)


class PackedWeight(nn.Module):
    """MXFP4 weight as the checkpoint stores it: `weight_packed` (2 codes/byte) + `weight_scale` (E8M0)."""

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(self, n_out: int, n_in: int, group: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.register_buffer("weight_packed", torch.zeros(n_out, n_in // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(n_out, n_in // group, dtype=torch.uint8, device=device))
        self.group = group

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight_packed, self.weight_scale, dtype, self.group)


def _packed_weight(expert: nn.Module, name: str) -> PackedWeight:
    w = getattr(expert, name)
    if not isinstance(w, PackedWeight):
        raise TypeError(f"expert weight {name} is {type(w).__name__}, not MXFP4 (PackedWeight)")
    return w


def _stack(parts: list[list[PackedWeight]]) -> tuple[torch.Tensor, torch.Tensor]:
    """parts[e]: the weights whose rows, in order, make expert e's matrix -> (codes [E, rows, in/2], scales
    [E, rows, in/g]); every weight's buffers become views of the two stacks."""
    stacks = []
    for attr in ("weight_packed", "weight_scale"):
        first: torch.Tensor = getattr(parts[0][0], attr)
        rows = sum(getattr(w, attr).shape[0] for w in parts[0])
        stack = torch.empty(len(parts), rows, first.shape[1], dtype=torch.uint8, device=first.device)
        for e, weights in enumerate(parts):
            row = 0
            for w in weights:
                t = getattr(w, attr)
                view = stack[e, row:row + t.shape[0]]
                view.copy_(t)
                setattr(w, attr, view)
                row += t.shape[0]
        stacks.append(stack)
    return stacks[0], stacks[1]


class Expert(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        Din, I = cfg.expert_in_dim, cfg.moe_intermediate_size
        shapes = {"w1": (I, Din), "w3": (I, Din), "w2": (Din, I)}
        for name, (n_out, n_in) in shapes.items():
            if cfg.experts_quantized:
                setattr(self, name, PackedWeight(n_out, n_in, cfg.mxfp4_group_size, device))
            else:
                setattr(self, name, linear(n_in, n_out, dtype, device))

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1 gate, w3 up, w2 down) dense in `dtype`."""
        out = []
        for name in ("w1", "w3", "w2"):
            w = self.get_submodule(name)
            out.append(w.dense(dtype) if isinstance(w, PackedWeight) else w.get_parameter("weight"))
        return out[0], out[1], out[2]


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str | None = None,
                 mxfp4_mode: str = "cached", tile_tokens: int | None = None) -> None:
        super().__init__()
        if mxfp4_mode not in MXFP4_MODES:
            raise ValueError(f"mxfp4_mode must be one of {MXFP4_MODES}; got {mxfp4_mode!r}")
        H = cfg.hidden_size
        self.dtype, self.mxfp4_mode = dtype, mxfp4_mode
        self.quantized, self.latent = cfg.experts_quantized, cfg.uses_latent_moe
        self.act = glu_activation(cfg)
        self.glu = GluSpec(cfg.hidden_act, cfg.situ_beta or 1.0, cfg.situ_linear_beta)  # the same GLU, for kernels
        self.gate = Router(cfg, device)
        self.experts = nn.ModuleList(Expert(cfg, dtype, device) for _ in range(cfg.num_experts))
        self.shared_experts = GatedMLP(cfg, H, cfg.shared_intermediate_size, dtype, device, tile_tokens)
        if self.latent:
            L = cfg.latent_size
            self.routed_expert_down_proj = linear(H, L, dtype, device)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps, dtype)
            self.routed_expert_up_proj = linear(L, H, dtype, device)
        self.num_experts, self.intermediate_size = cfg.num_experts, cfg.moe_intermediate_size
        self._dense: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        self._packed: PackedExperts | None = None

    @property
    def is_packed(self) -> bool:
        return self.quantized and self.mxfp4_mode == "packed"

    def invalidate(self) -> None:
        """Drop dequantized / stacked weights (call after loading new weights)."""
        self._dense = None
        self._stacked = None
        self._packed = None

    def packed_experts(self) -> PackedExperts:
        """The MXFP4 experts stacked as [E, 2I, D/2] codes + [E, 2I, D/g] scales (w1 rows then w3 rows) and
        [E, D, I/2] + [E, D, I/g] (w2). Each expert's buffers are re-pointed at views of the stack, so the
        layer holds the checkpoint's bytes once."""
        if not self.quantized:
            raise ValueError("packed_experts needs MXFP4 experts; this layer's experts are dense")
        if self._packed is None:
            w13 = _stack([[_packed_weight(ex, "w1"), _packed_weight(ex, "w3")] for ex in self.experts])
            w2 = _stack([[_packed_weight(ex, "w2")] for ex in self.experts])
            self._packed = PackedExperts(*w13, *w2, group=_packed_weight(self.experts[0], "w1").group)
        return self._packed

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts as [E, 2I, D] (w1 rows then w3 rows) and [E, D, I] for the grouped-GEMM path.

        Dense experts are re-pointed at views of the stack (and the dequantized cache likewise), so
        stacking costs no second copy of the weights."""
        if self._stacked is None:
            ws = [self.expert_weights(e) for e in range(self.num_experts)]
            w13 = torch.stack([torch.cat([w1, w3], dim=0) for w1, w3, _ in ws])
            w2 = torch.stack([w for _, _, w in ws])
            del ws
            I = self.intermediate_size
            if not self.quantized:
                for e, ex in enumerate(self.experts):
                    for name, view in (('w1', w13[e, :I]), ('w3', w13[e, I:]), ('w2', w2[e])):
                        ex.get_parameter(f"{name}.weight").data = view
            elif self.mxfp4_mode == "cached":
                self._dense = [(w13[e, :I], w13[e, I:], w2[e]) for e in range(self.num_experts)]
            self._stacked = (w13, w2)
        return self._stacked

    def expert(self, e: int) -> Expert:
        expert = self.experts[e]
        if not isinstance(expert, Expert):
            raise TypeError(f"experts[{e}] is a {type(expert).__name__}, not an Expert")
        return expert

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.quantized or self.mxfp4_mode in ("per_use", "packed"):  # packed: the reference's dense view
            return self.expert(e).weights(self.dtype)
        if self._dense is None:
            self._dense = [self.expert(i).weights(self.dtype) for i in range(self.num_experts)]
        return self._dense[e]

    def combine(self, x_in: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """sum_k w_k expert_k(x_in) in fp32 [T, Din]; each token's terms are added in ascending expert order."""
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens, w_sorted = order // k, weights.reshape(-1)[order]
        out = torch.zeros(x_in.shape, dtype=torch.float32, device=x_in.device)
        start = 0
        for e, count in enumerate(torch.bincount(flat, minlength=len(self.experts)).tolist()):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            w1, w3, w2 = self.expert_weights(e)
            xe = x_in.index_select(0, rows)
            ye = F.linear(self.act(F.linear(xe, w1), F.linear(xe, w3)), w2)
            out.index_add_(0, rows, ye.float() * w_sorted[start:start + count, None])
            start += count
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)
        if not (self.latent or self.is_packed):  # the shared expert's output joins the routed sum's last launch
            return moe_combine(self, x, weights, idx, add=self.shared_experts(x))
        x_in = self.routed_expert_down_proj(x) if self.latent else x
        if self.is_packed:
            y = moe_packed_combine(x_in, self.packed_experts(), weights, idx, self.act).to(x.dtype)
        else:
            y = moe_combine(self, x_in, weights, idx).to(x.dtype)  # latent: the norm and up_proj come first
        if self.latent:
            if hasattr(self, "routed_expert_norm"):
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        return y + self.shared_experts(x)
