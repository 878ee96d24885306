"""transformers' KimiLinearForCausalLM built on meta and filled with our weights: the baseline a user would otherwise
run (fla kernels on CUDA, bf16) and the fp32 gold the bench and the served.vs_transformers check judge against."""

from __future__ import annotations

from typing import Any

import torch

from k3verify.config import ModelConfig


def hf_config(hf_dict: dict[str, Any]):
    from transformers import KimiLinearConfig

    keep = {k: v for k, v in hf_dict.items() if k not in ("architectures", "auto_map", "model_type")}
    return KimiLinearConfig(**keep)


def build_hf_model(hf_dict: dict[str, Any], device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """Meta build, then real storage on `device`; every parameter is filled by the caller."""
    from transformers import KimiLinearForCausalLM

    cfg = hf_config(hf_dict)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = KimiLinearForCausalLM(cfg)
    model = model.to_empty(device=device)
    fp32 = ("e_score_correction_bias", "gate.weight", "dt_bias", "A_log")
    for name, p in model.named_parameters():
        if not any(k in name for k in fp32):
            p.data = p.data.to(dtype)
    for name, b in model.named_buffers():
        if not any(k in name for k in fp32) and b.is_floating_point():
            b.data = b.data.to(dtype)
    return model.eval()


def fill_random(model: torch.nn.Module, seed: int = 0) -> None:
    """Name-independent quick fill for a baseline-only run (std 1/sqrt(fan_in); norms ~1)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or "norm" in name:
                p.uniform_(0.8, 1.2, generator=g)
            elif "A_log" in name:
                p.uniform_(0.0, 2.7, generator=g)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.1, generator=g)


def load_baseline(cfg: ModelConfig, hf_dict: dict[str, Any], tensors: Any, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """transformers' KimiLinearForCausalLM (fla kernels on CUDA) holding exactly our weights."""
    from k3verify.oracle.hf_kimi_linear import dense_module_tensors, hf_state_dict

    hf = build_hf_model(hf_dict, device, dtype)
    sd = hf_state_dict(cfg, dense_module_tensors(cfg, tensors))
    targets = dict(hf.named_parameters()) | dict(hf.named_buffers())
    if set(targets) != set(sd):
        raise RuntimeError(f"baseline/our name sets differ: {sorted(set(targets) ^ set(sd))[:8]}")
    with torch.no_grad():
        for name, dest in targets.items():
            dest.copy_(sd.pop(name))
    return hf
