"""The bench's gold and baseline for a K3 preset, which transformers cannot run: the eager K3 reference.

fp32 reference logits are the gold both bf16 runs are held to; the same reference in bf16 is the baseline
whose own distance to the gold sets the bar (as transformers+fla's does for Kimi-Linear presets). Each
reference is built on the meta device and materialised on the bench's device, so a real-width slice never
passes through host memory, and is dropped before the next one is built.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from k3verify.checkpoint.loader import load_into
from k3verify.config import ModelConfig
from k3verify.oracle.k3_reference import K3Reference


def reference_logits(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], ids: torch.Tensor, device: torch.device,
                     dtype: torch.dtype) -> torch.Tensor:
    """K3Reference(cfg, dtype) loaded with `tensors` on `device` -> fp32 logits [T, V] of one sequence."""
    with torch.device("meta"):
        ref = K3Reference(cfg, dtype)
    ref = ref.to_empty(device=device)
    load_into(ref, cfg, tensors)
    logits = ref(ids.to(device)).logits.float()
    del ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return logits


def k3_gold_and_baseline(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], ids: torch.Tensor,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 gold logits, bf16 reference logits) of `ids` [T]."""
    if not cfg.is_k3:
        raise ValueError(f"the K3 reference gold needs a K3 config; {cfg.model_type!r} is not one")
    return (reference_logits(cfg, tensors, ids, device, torch.float32),
            reference_logits(cfg, tensors, ids, device, torch.bfloat16))
