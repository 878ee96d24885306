"""Module checks at any size, one layer at a time: memory is bounded by one layer, so a real-size checkpoint
(kl-48b-8l, 27.7 GB) is held to the oracle on one GPU.

For each layer i, only that layer's tensors are read from the checkpoint and loaded (strictly, through the one
loader) into three fresh modules: the oracle's layer in fp32 and in the serving dtype, and our serving layer in
the serving dtype. The inputs are captured activations: the oracle's own fp32 residual stream, advanced layer by
layer (SPEC §5's algebra for Block Attention Residuals), feeds each sublayer (attention, then FFN). Ours must sit
within max(floor, 1.5 x the oracle-in-the-serving-dtype's own distance) of the fp32 oracle, per sublayer: a 0/1
flag each, distances and bars as metrics. Control: our output one position late.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from k3verify.checkpoint.loader import load_into
from k3verify.config import ModelConfig
from k3verify.gates import CheckContext, Kind, Trial, register_check
from k3verify.gates.core.compare import rel_rms_error
from k3verify.gates.shared import builders
from k3verify.oracle.k3_reference import DecoderLayer as OracleLayer
from k3verify.oracle.k3_reference import K3Reference
from k3verify.serving.layers.decoder import DecoderLayer
from k3verify.serving.layers.moe import SparseMoE

FLOORS = {torch.float32: 1e-4, torch.bfloat16: 5e-3}  # where the oracle-at-dtype sits on the fp32 oracle
FACTOR = 1.5


class _At(nn.Module):
    """Holds one layer under `model.layers.{i}`, so its parameter names are the checkpoint's."""

    def __init__(self, i: int, layer: nn.Module) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(i): layer})


def _layer_tensors(ctx: CheckContext, i: int) -> dict[str, torch.Tensor]:
    """Layer i's checkpoint tensors, read once from disk (checkpoint names)."""
    tensors = builders.checkpoint_tensors(ctx)
    prefix = f"{ctx.cfg.checkpoint_prefix}model.layers.{i}."
    return {name: tensors[name] for name in tensors if name.startswith(prefix)}


def _meta_oracle(ctx: CheckContext, dtype: torch.dtype) -> K3Reference:
    """The oracle's tree on the meta device (no storage); layers are materialised one at a time."""
    key = f"layerwise.meta_oracle.{dtype}"
    if key not in ctx.cache:
        with torch.device("meta"):
            ctx.cache[key] = K3Reference(ctx.cfg, dtype)
    ref: K3Reference = ctx.cache[key]
    return ref


def _oracle_layer(ctx: CheckContext, i: int, dtype: torch.dtype, tensors: Mapping[str, torch.Tensor]) -> OracleLayer:
    layer = _meta_oracle(ctx, dtype).model.layers[i]
    assert isinstance(layer, OracleLayer)
    layer.to_empty(device=ctx.device)  # every parameter is then filled by the strict loader
    load_into(_At(i, layer), ctx.cfg, tensors)
    return layer


def _our_layer(ctx: CheckContext, i: int, tensors: Mapping[str, torch.Tensor]) -> DecoderLayer:
    with torch.device(ctx.device):  # built where it runs: a real-size MoE layer is 3.6 GB in bf16
        layer = DecoderLayer(ctx.cfg, i, ctx.dtype, ctx.device, "cached", None).to(ctx.device)
    load_into(_At(i, layer), ctx.cfg, tensors)
    for m in layer.modules():
        if isinstance(m, SparseMoE):
            m.invalidate()
    return layer


class _Stream:
    """The oracle's fp32 residual stream between layers: the partial sum p and, with Block Attention
    Residuals, the finished blocks (SPEC §5)."""

    def __init__(self, cfg: ModelConfig, embedded: torch.Tensor) -> None:
        self.cfg, self.p = cfg, embedded
        self.blocks: list[torch.Tensor] = []

    def attn_input(self, layer: OracleLayer, i: int) -> torch.Tensor:
        """The hidden state this layer's input_layernorm reads (appending a block where one starts)."""
        if not self.cfg.uses_attn_res:
            return self.p
        h = layer.mix("self_attention_res", self.p, self.blocks) if self.blocks else self.p
        assert self.cfg.attn_res_block_size is not None
        if i % self.cfg.attn_res_block_size == 0:
            self.blocks.append(self.p)
            self.p = torch.zeros_like(self.p)  # the new block's partial sum starts at the attention output
        return h

    def ffn_input(self, layer: OracleLayer, a: torch.Tensor) -> torch.Tensor:
        self.p = self.p + a
        return layer.mix("mlp_res", self.p, self.blocks) if self.cfg.uses_attn_res else self.p

    def finish(self, f: torch.Tensor) -> None:
        self.p = self.p + f


def _judge(gold: torch.Tensor, base: torch.Tensor, ours: torch.Tensor,
           floor: float) -> tuple[int, int, dict[str, float]]:
    """(candidate flag, control flag, metrics): ours within max(floor, 1.5 x base's distance) of the gold;
    the control is our output one position late."""
    d_base, d_ours = rel_rms_error(gold, base), rel_rms_error(gold, ours)
    bar = max(floor, FACTOR * d_base)
    late = torch.roll(ours, 1, dims=0)
    return int(d_ours <= bar), int(rel_rms_error(gold, late) <= bar), {"ours": d_ours, "oracle_dtype": d_base,
                                                                        "bar": bar}


@register_check(id="model.layerwise.sublayers", component="model", level="module", kind=Kind.BITEXACT,
                control="our sublayer output one position late")
@builders.single_thread
@torch.no_grad()
def check_layerwise(ctx: CheckContext) -> Trial:
    cfg, dtype = ctx.cfg, ctx.dtype
    T = 64 if ctx.device.type == "cuda" else 24
    ids = builders.prompt(ctx, T, salt=13).to(ctx.device)
    embed = builders.checkpoint_tensors(ctx)[f"{cfg.checkpoint_prefix}model.embed_tokens.weight"]
    stream = _Stream(cfg, embed.to(ctx.device)[ids].float())
    pass_ctx = builders.single_pass(builders.dummy_ids(T), ctx.device)
    flags: list[int] = []
    ctrl: list[int] = []
    metrics: dict[str, float] = {}
    for i in range(cfg.num_hidden_layers):
        tensors = _layer_tensors(ctx, i)
        gold, base, ours = _oracle_layer(ctx, i, torch.float32, tensors), _oracle_layer(ctx, i, dtype, tensors), \
            _our_layer(ctx, i, tensors)
        del tensors
        x = gold.input_layernorm(stream.attn_input(gold, i))
        a = gold.self_attn(x)
        f_ok, c_ok, m = _judge(a, base.self_attn(x.to(dtype)).float(),
                               ours.self_attn(x.to(dtype), pass_ctx).float(), FLOORS[dtype])
        _record(metrics, flags, ctrl, f"layers.{i}.attn", f_ok, c_ok, m)
        y = gold.post_attention_layernorm(stream.ffn_input(gold, a))
        f = gold.ffn(y)
        f_ok, c_ok, m = _judge(f, base.ffn(y.to(dtype)).float(), ours.ffn(y.to(dtype)).float(), FLOORS[dtype])
        _record(metrics, flags, ctrl, f"layers.{i}.ffn", f_ok, c_ok, m)
        stream.finish(f)
        for layer in (gold, base):
            layer.to_empty(device="meta")  # free the layer's storage before the next one
        del ours
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return Trial(reference=torch.ones(len(flags), dtype=torch.int64), candidate=torch.tensor(flags),
                 control=torch.tensor(ctrl), metrics=metrics,
                 notes=[f"{cfg.num_hidden_layers} layers one at a time, T={T}, serving dtype {_name(dtype)}; flags "
                        f"[attn, ffn] per layer: ours within max({FLOORS[dtype]:g}, {FACTOR} x the oracle in "
                        f"{_name(dtype)}) of the fp32 oracle on the oracle's own residual stream",
                        *_peak_note(ctx)])


def _record(metrics: dict[str, float], flags: list[int], ctrl: list[int], key: str, ok: int, ctrl_ok: int,
            values: dict[str, Any]) -> None:
    flags.append(ok)
    ctrl.append(ctrl_ok)
    metrics.update({f"{key}.{k}": float(v) for k, v in values.items()})


def _peak_note(ctx: CheckContext) -> list[str]:
    if ctx.device.type != "cuda":
        return []
    return [f"peak GPU memory allocated so far in this run: {torch.cuda.max_memory_allocated(ctx.device) / 1e9:.2f} "
            "GB"]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

