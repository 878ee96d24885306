"""Map tensor names written by transformers' KimiLinear back into our name map.

Two spellings reach us from transformers 5.24 (checked empirically against its conversion_mapping):
- `save_pretrained` reverts its load-time conversions and writes the published naming (separate
  `{q,k,v}_conv1d`, `block_sparse_moe.experts.{e}.w{1,2,3}`, `self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}`)
  with one quirk: its reverse of the `.block_sparse_moe.` -> `.mlp.` rename also renames the dense
  layer's `mlp.{gate,up,down}_proj` to `block_sparse_moe.{gate,up,down}_proj`.
- the live module's `state_dict()` (what `safetensors.save_file(model.state_dict())` writes) uses the
  runtime names: one fused `self_attn.conv1d.weight` [3·D, 1, W] (q|k|v), `self_attn.forget_gate.*`,
  `mlp.gate.*` / `mlp.shared_experts.*` on MoE layers, and experts merged per layer into
  `mlp.experts.gate_up_proj` [E, 2·I, H] (w1 rows then w3 rows) and `mlp.experts.down_proj` [E, H, I].
`hf_name_plan` maps either spelling (or ours) to our checkpoint names, splitting fused tensors by
index; any name it cannot place raises, so nothing is dropped silently.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from k3verify.checkpoint.names import checkpoint_specs, ignorable_reason
from k3verify.config import ModelConfig


class HfNameError(KeyError):
    """Tensor names that cannot be placed in our name map (or that collide)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Source:
    """Where one of our tensors comes from: `name`, whole (index None) or `name[index]`."""

    name: str
    index: tuple[int | slice, ...] | None = None


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FORGET_GATE = re.compile(r"^self_attn\.forget_gate\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$")
_MOE_RUNTIME = re.compile(r"^mlp\.((?:gate|shared_experts)\..+)$")
_DENSE_AS_MOE = re.compile(r"^block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")


def _layer_targets(cfg: ModelConfig, layer: int, rest: str, src: str) -> list[tuple[str, Source]] | None:
    """Our names (relative to `model.layers.{layer}.`) built from one source tensor, or None if unknown."""
    if rest == "self_attn.conv1d.weight":
        d = cfg.kda_dim
        return [(f"self_attn.{p}_conv1d.weight", Source(src, (slice(i * d, (i + 1) * d),)))
                for i, p in enumerate("qkv")]
    if m := _FORGET_GATE.match(rest):
        return [(f"self_attn.{m.group(1)}", Source(src))]
    moe = cfg.is_moe_layer(layer)
    if rest == "mlp.experts.gate_up_proj" and moe:
        inter = cfg.moe_intermediate_size
        out: list[tuple[str, Source]] = []
        for e in range(cfg.num_experts):
            out.append((f"block_sparse_moe.experts.{e}.w1.weight", Source(src, (e, slice(0, inter)))))
            out.append((f"block_sparse_moe.experts.{e}.w3.weight", Source(src, (e, slice(inter, 2 * inter)))))
        return out
    if rest == "mlp.experts.down_proj" and moe:
        return [(f"block_sparse_moe.experts.{e}.w2.weight", Source(src, (e,))) for e in range(cfg.num_experts)]
    if (m := _MOE_RUNTIME.match(rest)) and moe:
        return [(f"block_sparse_moe.{m.group(1)}", Source(src))]
    if (m := _DENSE_AS_MOE.match(rest)) and not moe:
        return [(f"mlp.{m.group(1)}", Source(src))]
    return None


def hf_name_plan(cfg: ModelConfig, names: Iterable[str]) -> dict[str, Source]:
    """{our checkpoint name: Source} for every transformers-written (or already-ours) name.

    Raises HfNameError listing every name that lands nowhere, and any two sources for one target."""
    plan, leftover, collisions = partial_name_plan(cfg, names)
    if leftover or collisions:
        raise HfNameError(f"{len(leftover)} tensor name(s) have no place in the {cfg.model_type} name map: "
                          f"{sorted(leftover)[:8]}; {len(collisions)} collision(s): {collisions[:4]}")
    return plan


def partial_name_plan(cfg: ModelConfig, names: Iterable[str]) -> tuple[dict[str, Source], list[str], list[str]]:
    """(plan, names it cannot place, collisions): the reconciler reports the last two in its buckets."""
    expected = set(checkpoint_specs(cfg))
    prefix = cfg.checkpoint_prefix
    plan: dict[str, Source] = {}
    leftover: list[str] = []
    collisions: list[str] = []
    for src in names:
        if src in expected or ignorable_reason(src) is not None:
            targets = [(src, Source(src))]
        else:
            bare = src[len(prefix):] if src.startswith(prefix) else None
            m = _LAYER.match(bare) if bare is not None else None
            rel = _layer_targets(cfg, int(m.group(1)), m.group(2), src) if m else None
            targets = [(f"{prefix}model.layers.{m.group(1)}.{name}", s) for name, s in rel] if m and rel else []
        if not targets or any(t not in expected for t, _ in targets):
            leftover.append(src)
            continue
        for target, source in targets:
            if target in plan:
                collisions.append(f"{target} <- {plan[target].name} and {source.name}")
            plan[target] = source
    return plan, leftover, collisions


def uses_transformers_names(cfg: ModelConfig, names: Iterable[str]) -> bool:
    """True when some names are transformers' spellings and every name has a place through the plan."""
    names = list(names)
    expected = set(checkpoint_specs(cfg))
    if all(n in expected or ignorable_reason(n) is not None for n in names):
        return False
    _, leftover, collisions = partial_name_plan(cfg, names)
    return not leftover and not collisions


def source_shape(shape: tuple[int, ...], source: Source) -> tuple[int, ...]:
    """The shape `source` selects from a stored tensor of `shape` (no data touched)."""
    if source.index is None:
        return tuple(shape)
    return tuple(torch.empty(shape, device="meta")[source.index].shape)


class NormalizedTensors(Mapping[str, torch.Tensor]):
    """A lazy view of `tensors` under our names; fused sources are loaded once and sliced (small cache)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], plan: Mapping[str, Source], cache_size: int = 4) -> None:
        self._tensors = tensors
        self.plan = dict(plan)
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_size = cache_size

    def _load(self, name: str) -> torch.Tensor:
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        value = self._tensors[name]
        self._cache[name] = value
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return value

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self.plan[name]
        if source.index is None:
            return self._tensors[source.name]
        return self._load(source.name)[source.index].contiguous()

    def __iter__(self) -> Iterator[str]:
        return iter(self.plan)

    def __len__(self) -> int:
        return len(self.plan)


def normalize_hf_names(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> NormalizedTensors:
    """`tensors` (a dict, a state_dict or a CheckpointReader) under our checkpoint names; raises on leftovers."""
    return NormalizedTensors(tensors, hf_name_plan(cfg, tensors.keys()))
