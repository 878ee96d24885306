"""K3Reference: an eager reference decoder for Kimi-K3 and Kimi-Linear, written from SPEC-K3.

The module tree mirrors the checkpoint names exactly (`module_specs(cfg)`, with MXFP4 expert pairs
held as dense `experts.{e}.wN.weight`), so `load_into(ref, cfg, tensors)` fills it strictly.
Parameters take the module dtype, or the checkpoint's dtype when that is wider (K3's fp32 conv
weights, A_log, dt_bias stay fp32 in a bf16 reference). One sequence at a time: ids [T] -> logits [T, V].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from k3verify.checkpoint.names import module_specs, quantized_pair
from k3verify.config import ModelConfig
from k3verify.oracle import active
from k3verify.oracle import functional as Fn
from k3verify.oracle.k3_layers import GLU, KDA, MLA, RMSNorm, SparseMoE, WeightOnly

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass
class ReferenceOutput:
    """logits [T, V] in the module dtype; captures (when asked) name -> [T, H]."""

    logits: torch.Tensor
    captures: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Carry:
    """What one decoder layer hands the next: the residual stream [T, H] (K3: the current block's partial sum)
    and, for K3's Block Attention Residuals, the finished block sums."""

    partial: torch.Tensor
    blocks: list[torch.Tensor] = field(default_factory=list)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps, dtype, knob="norm.input_layernorm_eps")
        self.post_attention_layernorm = RMSNorm(H, eps, dtype, knob="norm.post_attention_layernorm_eps")
        if cfg.uses_attn_res:
            self.self_attention_res_norm = WeightOnly(H, dtype=dtype)
            self.self_attention_res_proj = WeightOnly(1, H, dtype=dtype)
            self.mlp_res_norm = WeightOnly(H, dtype=dtype)
            self.mlp_res_proj = WeightOnly(1, H, dtype=dtype)
        self.self_attn = KDA(cfg, dtype) if cfg.layer_kind(index) == "kda" else MLA(cfg, dtype)
        if cfg.is_moe_layer(index):
            self.block_sparse_moe = SparseMoE(cfg, dtype, index)
        else:
            self.mlp = GLU(cfg, H, cfg.intermediate_size, dtype)
        self.eps = eps

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def attn_sublayer(self, h: torch.Tensor) -> torch.Tensor:
        """a = attn(input_layernorm(h)); [T, H] -> [T, H]."""
        return self.self_attn(self.input_layernorm(h))

    def ffn_sublayer(self, h: torch.Tensor) -> torch.Tensor:
        """f = mlp(post_attention_layernorm(h)); [T, H] -> [T, H]."""
        return self.ffn(self.post_attention_layernorm(h))

    def mix(self, pair: str, p: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        """Block Attention Residual mix with this layer's `{pair}_norm` / `{pair}_proj`."""
        norm, proj = getattr(self, f"{pair}_norm"), getattr(self, f"{pair}_proj")
        return Fn.attn_res_mix(p, blocks, norm.weight, proj.weight, active.current("attn_res.layer_mix_eps", self.eps),
                               active.in_activation("attn_res.softmax_precision"))


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.embed_tokens = WeightOnly(cfg.vocab_size, H, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype, knob="norm.final_norm_eps")
        if cfg.uses_attn_res:
            self.output_attn_res_norm = WeightOnly(H, dtype=dtype)
            self.output_attn_res_proj = WeightOnly(1, H, dtype=dtype)
        self.cfg = cfg

    def forward(self, input_ids: torch.Tensor, captures: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """ids [T] -> final hidden [T, H] after the final norm. Fills `captures` when given."""
        carry = self.start(self.embed_tokens.weight[input_ids])
        for i, layer in enumerate(self.decoder_layers()):
            carry = self.step(i, layer, carry, captures)
        return self.finish(carry, captures)

    def decoder_layers(self) -> list[DecoderLayer]:
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        if len(layers) != len(self.layers):
            raise TypeError("Model.layers holds a module that is not a DecoderLayer")
        return layers

    def start(self, x: torch.Tensor) -> Carry:
        """The state carried into layer 0 from the embeddings x [T, H]."""
        return Carry(partial=x)

    def step(self, i: int, layer: DecoderLayer, carry: Carry, captures: dict[str, torch.Tensor] | None) -> Carry:
        """Layer i over the carried state -> the state carried into layer i + 1. Kimi-Linear: plain pre-norm
        residual, h += a; h += f (h is carry.partial). K3 Block Attention Residuals (SPEC §5): partial is the
        running sum of the current block, blocks the finished block sums; the mixed h feeds only norms, never
        partial."""
        if not self.cfg.uses_attn_res:
            h = carry.partial
            a = layer.attn_sublayer(h)
            h = h + a
            f = layer.ffn_sublayer(h)
            _record(captures, i, a, f)
            return Carry(partial=h + f)
        blocks = list(carry.blocks)
        partial: torch.Tensor | None = carry.partial
        assert partial is not None
        h = layer.mix("self_attention_res", partial, blocks) if blocks else partial
        if i % self.cfg.residual_block_size == 0:
            blocks.append(partial)
            partial = None
        a = layer.attn_sublayer(h)
        partial = a if partial is None else partial + a
        h = layer.mix("mlp_res", partial, blocks)
        f = layer.ffn_sublayer(h)
        _record(captures, i, a, f)
        return Carry(partial=partial + f, blocks=blocks)

    def finish(self, carry: Carry, captures: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The carried state after the last layer -> final hidden [T, H]: the output mix (K3, mix-then-norm), then
        the final norm."""
        h = carry.partial
        if self.cfg.uses_attn_res:
            h = Fn.attn_res_mix(h, carry.blocks, self.output_attn_res_norm.weight, self.output_attn_res_proj.weight,
                                active.current("attn_res.output_mix_eps", self.cfg.rms_norm_eps),
                                active.in_activation("attn_res.softmax_precision"))
        out = self.norm(h)
        if captures is not None:
            captures["final_hidden"] = out
        return out


def _record(captures: dict[str, torch.Tensor] | None, i: int, a: torch.Tensor, f: torch.Tensor) -> None:
    if captures is not None:
        captures[f"layers.{i}.attn_out"] = a
        captures[f"layers.{i}.ffn_out"] = f


class K3Reference(nn.Module):
    """The eager reference: `model.*` and `lm_head`, named exactly as the checkpoint."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"K3Reference dtype must be a float dtype {_FLOAT_DTYPES}; got {dtype}")
        self.cfg, self.dtype = cfg, dtype
        self.model = Model(cfg, dtype)
        self.lm_head = WeightOnly(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        _match_checkpoint(self, cfg, dtype)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, capture: bool = False) -> ReferenceOutput:
        """input_ids LongTensor [T] (one sequence) -> logits [T, V]; captures per sublayer when asked."""
        if input_ids.dim() != 1:
            raise ValueError(f"K3Reference takes one sequence of ids [T]; got shape {tuple(input_ids.shape)}")
        captures: dict[str, torch.Tensor] | None = {} if capture else None
        hidden = self.model(input_ids, captures)
        logits = Fn.linear(hidden, self.lm_head.weight)
        return ReferenceOutput(logits=logits, captures=captures or {})


def expected_module_names(cfg: ModelConfig) -> dict[str, torch.dtype | None]:
    """module parameter name -> checkpoint dtype (None for MXFP4 experts, which dequantize to dense)."""
    out: dict[str, torch.dtype | None] = {}
    for name, spec in module_specs(cfg).items():
        pair = quantized_pair(name)
        if pair is not None:
            out[pair[0]] = None
        else:
            out[name] = spec.dtype
    return out


def _match_checkpoint(module: nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> None:
    """Fail at construction if the tree drifts from the names; widen params the checkpoint stores wider."""
    expected = expected_module_names(cfg)
    params = dict(module.named_parameters())
    missing, extra = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
    if missing or extra:
        raise AssertionError(f"K3Reference tree does not mirror the checkpoint names: missing {missing[:6]}, "
                             f"extra {extra[:6]}")
    for name, ckpt_dtype in expected.items():
        if ckpt_dtype is None or torch.promote_types(ckpt_dtype, dtype) == dtype:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        old = getattr(owner, attr)
        setattr(owner, attr, nn.Parameter(old.detach().to(ckpt_dtype), requires_grad=False))
