"""Strict loading of checkpoint tensors into a module through the one name map.

Every module parameter/buffer must get a source, every checkpoint tensor must land somewhere or be
declared ignorable (with a reason), and shapes must match; anything else raises naming the tensor. The one
shape exception is a named rule (checkpoint/tolerances.py: `a_log_padding`); dtypes are cast to the module's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from k3verify.checkpoint import mxfp4
from k3verify.checkpoint.names import quantized_pair, to_module_name
from k3verify.checkpoint.tolerances import A_LOG_PADDING, fit_a_log, shape_rule
from k3verify.config import ModelConfig
from k3verify.errors import BadTargetData


class WeightLoadError(ValueError):
    """Missing, unexpected or mis-shaped weights."""


class NonFiniteWeight(WeightLoadError, BadTargetData):
    """A checkpoint tensor that holds NaN or Inf as stored: the checkpoint is bad, whatever code reads it."""


def plan_sources(cfg: ModelConfig, ckpt_names: list[str], module_names: list[str]) -> dict[str, list[str]]:
    """module name -> the checkpoint names it is built from ([name], or [packed, scale] to dequantize)."""
    by_module: dict[str, str] = {}
    outside: list[str] = []  # names outside the K3 prefix and not ignorable: unexpected, not a KeyError crash
    for name in ckpt_names:
        try:
            mod = to_module_name(cfg, name)
        except KeyError:
            outside.append(name)
            continue
        if mod is not None:
            by_module[mod] = name
    wanted = set(module_names)
    plan: dict[str, list[str]] = {}
    used: set[str] = set()
    for mod in module_names:
        if mod in by_module:
            plan[mod] = [by_module[mod]]
            used.add(by_module[mod])
            continue
        base = mod[: -len(".weight")] if mod.endswith(".weight") else None
        packed, scale = (f"{base}.weight_packed", f"{base}.weight_scale") if base else (None, None)
        if base and packed in by_module and scale in by_module and quantized_pair(packed):
            plan[mod] = [by_module[packed], by_module[scale]]
            used.update(plan[mod])
    missing = sorted(set(module_names) - set(plan))
    unexpected = sorted(outside + [n for mod, n in by_module.items() if n not in used and mod not in wanted])
    if missing or unexpected:
        raise WeightLoadError(
            f"weights do not match the model: {len(missing)} module tensor(s) without a source "
            f"{missing[:8]}{' …' if len(missing) > 8 else ''}; {len(unexpected)} checkpoint tensor(s) without a "
            f"destination {unexpected[:8]}{' …' if len(unexpected) > 8 else ''}"
        )
    return plan


@torch.no_grad()
def load_into(module: nn.Module, cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], prefix: str = "") -> None:
    """Copy checkpoint tensors into `module` (cast to each parameter's dtype), strictly. With `prefix`, only the
    module tensors named under it and the checkpoint tensors that map there (one layer of a streamed model:
    the whole name map is checked once by `plan_sources` over every name)."""
    state = {k: v for k, v in module.state_dict(keep_vars=True).items() if k.startswith(prefix)}
    names = list(tensors.keys()) if not prefix else [n for n in tensors.keys() if _maps_under(cfg, n, prefix)]
    plan = plan_sources(cfg, names, list(state.keys()))
    group = cfg.quant.group_size if cfg.quant is not None else mxfp4.GROUP
    for mod_name, sources in plan.items():
        dest = state[mod_name]
        if len(sources) == 2:
            value = mxfp4.dequantize(tensors[sources[0]], tensors[sources[1]], torch.float32, group)
        else:
            value = tensors[sources[0]]
        check_finite(" + ".join(sources), mod_name, value, stored=len(sources) == 1)
        if tuple(value.shape) != tuple(dest.shape):
            value = _fit_shape(cfg, sources[0], mod_name, value, tuple(dest.shape))
        if dest.dtype == torch.uint8 and value.dtype != torch.uint8:
            raise WeightLoadError(f"{sources[0]} must be uint8 for {mod_name}; got {value.dtype}")
        dest.copy_(value.to(device=dest.device, dtype=dest.dtype))


def _maps_under(cfg: ModelConfig, name: str, prefix: str) -> bool:
    try:
        mod = to_module_name(cfg, name)
    except KeyError:
        return False
    return mod is not None and mod.startswith(prefix)


def check_finite(source: str, mod_name: str, value: torch.Tensor, *, stored: bool = False) -> None:
    """WeightLoadError naming the checkpoint tensor when it holds NaN or Inf: a model built from it would fail its
    checks (or serve NaN logits) with nothing pointing back at the tensor. `stored`: `value` is the tensor as the
    checkpoint stores it (not computed from it, as a dequantized one is), so the checkpoint itself is bad:
    NonFiniteWeight, which stops a parity run at once."""
    if not value.is_floating_point() or value.is_meta:
        return
    bad = ~torch.isfinite(value)
    if not bool(bad.any()):
        return
    nan, total = int(torch.isnan(value).sum()), int(bad.sum())
    first = tuple(int(i) for i in bad.nonzero()[0])
    error = NonFiniteWeight if stored else WeightLoadError
    raise error(f"checkpoint tensor {source} (for {mod_name}, {tuple(value.shape)} {value.dtype}) holds "
                f"{nan} NaN and {total - nan} Inf value(s) of {value.numel()}, the first at index {first}")


def _fit_shape(cfg: ModelConfig, source: str, mod_name: str, value: torch.Tensor,
               dest_shape: tuple[int, ...]) -> torch.Tensor:
    """A shape the module does not hold is accepted only under a named rule; otherwise raise naming both."""
    if shape_rule(cfg, mod_name, tuple(value.shape), dest_shape) is not None or (
            A_LOG_PADDING.applies_to.search(mod_name) and value.dim() == 1 and len(dest_shape) == 1):
        try:
            return fit_a_log(cfg, source, value, dest_shape)  # raises for an A_log shorter than the heads
        except ValueError as exc:
            raise WeightLoadError(str(exc)) from exc
    raise WeightLoadError(f"shape mismatch for {source}: checkpoint {tuple(value.shape)} vs module "
                          f"{mod_name} {dest_shape}")
