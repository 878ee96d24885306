"""What real checkpoints carry that differs from our spec, each accepted by one named rule.

The reconciler and the loader are strict; these rules are the only exceptions, each for a fact about
checkpoints written by other tools, and every use of one is reported (reconcile output, the weights
checks' notes in report.json):

- `keep_in_fp32`: transformers' KimiLinear declares `_keep_in_fp32_modules_strict = ["e_score_correction_bias",
  "gate.weight", "dt_bias"]`, so router weights (and the two biases) arrive in fp32 where our spec says bf16.
  The serving router computes in fp32 anyway; the loader casts to each parameter's dtype.
- `a_log_bf16`: transformers writes `A_log` in the model's dtype (bf16). Widening bf16 to fp32 is exact.
- `a_log_padding`: `A_log` is a 1-D vector of any length >= the KDA head count (K3 pads to a power of two,
  other writers to the head dim); only the first `heads` entries are ever read. Shorter is an error.

Everything else (transposes, other shapes, other dtypes, unknown or missing names) stays a mismatch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from k3verify.config import ModelConfig


@dataclass(frozen=True)
class ToleranceRule:
    id: str
    applies_to: re.Pattern[str]  # searched in the module (or checkpoint) name
    reason: str


KEEP_IN_FP32 = ToleranceRule(
    "keep_in_fp32", re.compile(r"(\.block_sparse_moe\.gate\.(weight|e_score_correction_bias)|\.self_attn\.dt_bias)$"),
    "fp32 where bf16 is expected: transformers keeps router gate.weight, e_score_correction_bias and dt_bias in "
    "fp32 (_keep_in_fp32_modules_strict); cast to the parameter's dtype on load")
A_LOG_BF16 = ToleranceRule(
    "a_log_bf16", re.compile(r"\.self_attn\.A_log$"),
    "A_log stored in bf16 where fp32 is expected (transformers writes it in the model dtype); widened exactly")
A_LOG_PADDING = ToleranceRule(
    "a_log_padding", re.compile(r"\.self_attn\.A_log$"),
    "A_log longer than the KDA head count: only the first `heads` entries are read, the rest is padding")
RULES = (KEEP_IN_FP32, A_LOG_BF16, A_LOG_PADDING)

_NARROW_FLOATS = (torch.bfloat16, torch.float16)


def dtype_rule(name: str, found: torch.dtype, expected: torch.dtype) -> ToleranceRule | None:
    """The rule that accepts `found` for a tensor whose spec says `expected`, or None (a mismatch)."""
    if found == torch.float32 and expected in _NARROW_FLOATS and KEEP_IN_FP32.applies_to.search(name):
        return KEEP_IN_FP32
    if found == torch.bfloat16 and expected == torch.float32 and A_LOG_BF16.applies_to.search(name):
        return A_LOG_BF16
    return None


def shape_rule(cfg: ModelConfig, name: str, found: tuple[int, ...],
               expected: tuple[int, ...]) -> ToleranceRule | None:
    """The rule that accepts shape `found` where `expected` is specified, or None (a mismatch)."""
    if not A_LOG_PADDING.applies_to.search(name) or len(found) != 1 or len(expected) != 1:
        return None
    return A_LOG_PADDING if found[0] >= cfg.kda_num_heads else None


def a_log_padding_detail(cfg: ModelConfig, value: torch.Tensor) -> str:
    """What a padded A_log carries past the heads (reported, never read)."""
    heads = cfg.kda_num_heads
    pad = value.reshape(-1)[heads:].float()
    if pad.numel() == 0:
        return f"length {value.numel()} = {heads} heads, no padding"
    uniq = torch.unique(pad)
    shown = ", ".join(f"{v:g}" for v in uniq[:4].tolist()) + (", …" if uniq.numel() > 4 else "")
    return (f"length {value.numel()} for {heads} heads: {pad.numel()} padding value(s), "
            f"{uniq.numel()} distinct ({shown}), range [{pad.min().item():g}, {pad.max().item():g}]")


def fit_a_log(cfg: ModelConfig, name: str, value: torch.Tensor, dest_shape: tuple[int, ...]) -> torch.Tensor:
    """A stored 1-D A_log of any length >= heads, laid into the module's width: the first `heads` entries
    exactly, the module's remaining width NaN (never read; NaN makes a read of it loud)."""
    heads = cfg.kda_num_heads
    if value.dim() != 1 or len(dest_shape) != 1:
        raise ValueError(f"{name}: A_log must be 1-D to be re-padded; got stored {tuple(value.shape)} for module "
                         f"{dest_shape}")
    if value.numel() < heads:
        raise ValueError(f"{name}: A_log has {value.numel()} entries but the config has {heads} KDA heads; "
                         "a shorter A_log cannot be used")
    out = torch.full(dest_shape, float("nan"), dtype=torch.float32)
    n = min(dest_shape[0], value.numel())
    out[:n] = value[:n].float()
    return out
