"""Which slice of which checkpoint tensor fills each parameter of one rank, and loading exactly that.

A rank reads only its slices (`CheckpointReader.get_slice`, safetensors slicing: the rest of a tensor is
never read), replicated tensors whole, and its own experts whole under their global ids. Module names are
checkpoint names (less K3's prefix) except routed experts, which a rank numbers from 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from k3verify.checkpoint.loader import WeightLoadError, check_finite
from k3verify.checkpoint.reader import CheckpointReader
from k3verify.checkpoint.snapshot import SnapshotTensors
from k3verify.config import ModelConfig
from k3verify.serving.parallel.layout import ParallelLayout

Tensors = Mapping[str, torch.Tensor]  # a CheckpointReader, or checkpoint tensors already in memory


@dataclass(frozen=True)
class SliceSpec:
    """Fill a parameter with `source[..., start:stop, ...]` along `dim` (dim None: the whole tensor)."""

    source: str  # checkpoint name, prefix included
    dim: int | None = None
    start: int = 0
    stop: int = 0

    def describe(self) -> str:
        return self.source if self.dim is None else f"{self.source}[{self.start}:{self.stop} along dim {self.dim}]"


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(.*)$")
# parameter suffix -> (dim, unit): a head-split tensor is sliced along `dim` in units of `unit` rows per head
_KDA_SPLIT = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "q_conv1d.weight": 0,
              "k_conv1d.weight": 0, "v_conv1d.weight": 0, "f_b_proj.weight": 0, "dt_bias": 0, "g_proj.weight": 0,
              "g_b_proj.weight": 0, "o_proj.weight": 1}
_GLU_SPLIT = {"gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1}


def head_rows(heads: tuple[int, int], width: int) -> tuple[int, int]:
    """Rows [start, stop) of the heads [h0, h1) in a tensor laid out head-major, `width` rows per head."""
    return heads[0] * width, heads[1] * width


def _attention_rule(cfg: ModelConfig, layout: ParallelLayout, layer: int, suffix: str) -> SliceSpec | None:
    """(dim, start, stop) of a head-split attention tensor; None for a tensor every rank holds whole."""
    if cfg.layer_kind(layer) == "kda":
        heads = layout.tp_range(cfg.kda_num_heads)
        if suffix == "b_proj.weight":
            return SliceSpec("", 0, *heads)
        if suffix == "A_log":
            return SliceSpec("", 0 if cfg.is_k3 else 2, *heads)
        if suffix in _KDA_SPLIT:
            return SliceSpec("", _KDA_SPLIT[suffix], *head_rows(heads, cfg.kda_head_dim))
        return None
    heads = layout.tp_range(cfg.num_attention_heads)
    widths = {"q_proj.weight": (0, cfg.qk_head_dim), "q_b_proj.weight": (0, cfg.qk_head_dim),
              "kv_b_proj.weight": (0, cfg.qk_nope_head_dim + cfg.v_head_dim), "g_proj.weight": (0, cfg.v_head_dim),
              "o_proj.weight": (1, cfg.v_head_dim)}
    if suffix in widths:
        dim, width = widths[suffix]
        return SliceSpec("", dim, *head_rows(heads, width))
    return None


def _ffn_rule(cfg: ModelConfig, layout: ParallelLayout, layer: int, suffix: str) -> SliceSpec | None:
    if suffix.startswith("mlp.") and suffix[4:] in _GLU_SPLIT:
        return SliceSpec("", _GLU_SPLIT[suffix[4:]], *layout.tp_range(cfg.intermediate_size))
    shared = "block_sparse_moe.shared_experts."
    if suffix.startswith(shared) and suffix[len(shared):] in _GLU_SPLIT:
        return SliceSpec("", _GLU_SPLIT[suffix[len(shared):]], *layout.tp_range(cfg.shared_intermediate_size))
    latent = {"block_sparse_moe.routed_expert_down_proj.weight": 0, "block_sparse_moe.routed_expert_up_proj.weight": 1}
    if suffix in latent:
        return SliceSpec("", latent[suffix], *layout.tp_range(cfg.expert_in_dim))
    return None


def shard_spec(cfg: ModelConfig, layout: ParallelLayout, module_name: str) -> SliceSpec:
    """The slice that fills this rank's parameter `module_name`."""
    source, rule = cfg.checkpoint_prefix + module_name, None
    if module_name in ("model.embed_tokens.weight", "lm_head.weight"):
        rule = SliceSpec("", 0, *layout.tp_range(cfg.vocab_size))
    elif (m := _LAYER.match(module_name)) is not None:
        layer, suffix = int(m.group(1)), m.group(2)
        if (e := _EXPERT.match(suffix)) is not None:
            first = layout.ep_range(cfg.num_experts)[0]
            expert = f"block_sparse_moe.experts.{first + int(e.group(1))}.{e.group(2)}"
            return SliceSpec(f"{cfg.checkpoint_prefix}model.layers.{layer}.{expert}")
        if suffix.startswith("self_attn."):
            rule = _attention_rule(cfg, layout, layer, suffix[len("self_attn."):])
        else:
            rule = _ffn_rule(cfg, layout, layer, suffix)
    if rule is None or layout.tp == 1:  # with tp = 1 every rule's range is the whole tensor
        return SliceSpec(source)
    return SliceSpec(source, rule.dim, rule.start, rule.stop)


def shard_specs(cfg: ModelConfig, layout: ParallelLayout, module_names: list[str]) -> dict[str, SliceSpec]:
    return {name: shard_spec(cfg, layout, name) for name in module_names}


def read_spec(tensors: Tensors, spec: SliceSpec) -> torch.Tensor:
    """The slice itself: a CheckpointReader reads only those bytes; an in-memory mapping is narrowed."""
    if spec.source not in tensors:
        raise WeightLoadError(f"the checkpoint has no tensor {spec.source!r}")
    if spec.dim is None:
        return tensors[spec.source]
    if isinstance(tensors, CheckpointReader | SnapshotTensors):
        return tensors.get_slice(spec.source, spec.dim, spec.start, spec.stop)
    return tensors[spec.source].narrow(spec.dim, spec.start, spec.stop - spec.start)


@torch.no_grad()
def load_rank(module: nn.Module, cfg: ModelConfig, layout: ParallelLayout, tensors: Tensors,
              read: Callable[[Tensors, SliceSpec], torch.Tensor] = read_spec) -> dict[str, SliceSpec]:
    """Fill every parameter and buffer of this rank's `module` from its slices, strictly: a missing source or
    a slice whose shape differs from the parameter raises naming the tensor, the slice and the rank."""
    state = module.state_dict(keep_vars=True)
    specs = shard_specs(cfg, layout, list(state))
    for name, dest in state.items():
        spec = specs[name]
        value = read(tensors, spec)
        check_finite(spec.describe(), name, value)
        if tuple(value.shape) != tuple(dest.shape):
            raise WeightLoadError(f"rank {layout.rank} ({layout.describe()}): {spec.describe()} has shape "
                                  f"{tuple(value.shape)}, but parameter {name} is {tuple(dest.shape)}")
        if dest.dtype == torch.uint8 and value.dtype != torch.uint8:
            raise WeightLoadError(f"{spec.source} must be uint8 for {name}; got {value.dtype}")
        dest.copy_(value.to(device=dest.device, dtype=dest.dtype))
    return specs
