"""A slice of the model for a check that needs a whole model which may not be built at real size.

The slice keeps the first and the last decoder layer and the first layer of every attention kind (KDA, MLA) and
every FFN kind (dense MLP, MoE) those two do not already hold, in their order (with Block Attention Residuals, the
first layers up to one past the first block too, so the slice holds a finished block and a block in progress),
with everything outside the layers (embeddings, final norm and output mix, lm_head). It is a model of its own,
built from the same checkpoint (its layers renumbered 0..n-1) with the same config but for the layer lists; a
check compares its reference and candidate on it as on any model. Its result says which layers of how many it
held (gates/core/suite.py runs the check again on it).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from k3verify.config import ModelConfig
from k3verify.gates.core.check import CheckContext, SkipCheck
from k3verify.gates.core.noise import NoiseLookup
from k3verify.target import Target

SLICE_CACHE = "slice.cache"  # ctx.cache key: the slice's own cache (its models), shared by every sliced check
PARENT_CACHE = "slice.parent_cache"  # in the slice's cache: the run's cache it hangs from (builders.make_room)
_LAYER = re.compile(r"(^|\.)model\.layers\.(\d+)\.")


def slice_layers(cfg: ModelConfig) -> list[int]:
    """0-based layers of the slice: first, last, and the first layer of each attention and FFN kind not in them."""
    n = cfg.num_hidden_layers
    keep = {0, n - 1} | (set(range(min(n, cfg.residual_block_size + 1))) if cfg.uses_attn_res else set())
    seen = {k for i in keep for k in _kinds(cfg, i)}
    for i in range(n):
        if not _kinds(cfg, i) <= seen:
            seen |= _kinds(cfg, i)
            keep.add(i)
    return sorted(keep)


def _kinds(cfg: ModelConfig, layer: int) -> set[str]:
    return {cfg.layer_kind(layer), "moe" if cfg.is_moe_layer(layer) else "dense"}


def sliced_hf_config(hf: dict[str, Any], cfg: ModelConfig, keep: list[int]) -> dict[str, Any]:
    """The config.json dict of the slice: the layer count, the 1-based KDA / full-attention lists and the number of
    leading dense layers of `keep`; a model whose MoE layers are not all after its dense ones cannot be sliced."""
    if cfg.moe_layer_freq != 1:
        raise SkipCheck(f"moe_layer_freq={cfg.moe_layer_freq}: a slice cannot keep every layer's FFN kind")
    out = copy.deepcopy(hf)
    text = out["text_config"] if "text_config" in out else out
    text["num_hidden_layers"] = len(keep)
    lin = text["linear_attn_config"]
    lin["kda_layers"] = [j + 1 for j, i in enumerate(keep) if cfg.layer_kind(i) == "kda"]
    lin["full_attn_layers"] = [j + 1 for j, i in enumerate(keep) if cfg.layer_kind(i) == "mla"]
    text["first_k_dense_replace"] = sum(1 for i in keep if i < cfg.first_k_dense_replace)
    for key in ("layer_types", "mlp_layer_types"):  # transformers' echoes of the layer lists
        if key in text:
            text[key] = [text[key][i] for i in keep]
    return out


class SlicedTensors(Mapping[str, torch.Tensor]):
    """The checkpoint's tensors as the slice names them: layer keep[j] read as layer j, other layers left out."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], keep: list[int]) -> None:
        self.tensors = tensors
        new = {old: j for j, old in enumerate(keep)}
        self.names: dict[str, str] = {}
        for name in tensors.keys():
            m = _LAYER.search(name)
            if m is None:
                self.names[name] = name
            elif int(m.group(2)) in new:
                self.names[name[:m.start(2)] + str(new[int(m.group(2))]) + name[m.end(2):]] = name

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[self.names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


@dataclasses.dataclass(frozen=True)
class SlicedTarget(Target):
    """A target that is a slice of `source`: the same files, a config and tensors of `layers` only."""

    source: Target | None = None
    layers: tuple[int, ...] = ()
    hf: dict[str, Any] = dataclasses.field(default_factory=dict)

    def hf_config(self) -> dict[str, Any]:
        return copy.deepcopy(self.hf)

    def weights(self) -> Mapping[str, torch.Tensor]:
        assert self.source is not None
        return SlicedTensors(self.source.weights(), list(self.layers))


def slice_target(target: Target) -> SlicedTarget:
    cfg = target.cfg
    keep = slice_layers(cfg)
    hf = sliced_hf_config(target.hf_config(), cfg, keep)
    sliced_cfg = ModelConfig.from_hf_dict(hf, generation_eos=cfg.eos_token_ids)
    return SlicedTarget(cfg=sliced_cfg, name=f"{target.name} (layers {keep})", preset=None,
                        checkpoint_dir=target.checkpoint_dir, digest=target.digest, names=target.names,
                        source=target, layers=tuple(keep), hf=hf)


def slice_context(ctx: CheckContext) -> tuple[CheckContext, str]:
    """ctx on the slice (its own cache, kept for every sliced check of the run) and the words its result says."""
    if ctx.cache.get(SLICE_CACHE) is None:
        ctx.cache[SLICE_CACHE] = {"target": slice_target(ctx.target), PARENT_CACHE: ctx.cache}
    cache: dict[str, Any] = ctx.cache[SLICE_CACHE]
    target: SlicedTarget = cache["target"]
    noise = None if ctx.noise is None else NoiseLookup(None, None, "a slice of the model: noise measured at run time")
    sliced = dataclasses.replace(ctx, target=target, cache=cache, noise=noise, serving_dtypes=set(), run_notes=[],
                                 slicer=None)
    n = ctx.cfg.num_hidden_layers
    kinds = ", ".join(f"{i} {ctx.cfg.layer_kind(i)}/{'moe' if ctx.cfg.is_moe_layer(i) else 'dense'}"
                      for i in target.layers)
    return sliced, (f"decoder layers [{kinds}] of {n} (0-based: the first, the last and one of each attention and "
                    "FFN kind), with the embeddings, final norm and lm_head")
