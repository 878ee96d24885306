"""Cached oracle objects for checks: weights, the K3 reference, transformers' model (ctx.cache)."""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from k3verify.checkpoint.init import synthetic_tensors
from k3verify.checkpoint.loader import load_into
from k3verify.oracle.k3_reference import K3Reference
from k3verify.presets import preset_hf_config


def _cached(ctx: Any, key: str, build: Any) -> Any:
    if key not in ctx.cache:
        ctx.cache[key] = build()
    return ctx.cache[key]


def checkpoint_tensors(ctx: Any) -> Mapping[str, torch.Tensor]:
    """Checkpoint-named tensors: the checkpoint at ctx.checkpoint_dir (read lazily), else the preset's
    name-seeded synthetic weights (seed 0, so every stack and every run sees the same values)."""
    def build() -> Mapping[str, torch.Tensor]:
        if ctx.checkpoint_dir is not None:
            try:
                reader = importlib.import_module("k3verify.checkpoint.reader")
            except ImportError:
                reader = None
            if reader is not None:
                return reader.CheckpointReader(ctx.checkpoint_dir)
        return synthetic_tensors(ctx.cfg, seed=0)
    return _cached(ctx, "oracle.tensors", build)


def hf_config_dict(ctx: Any) -> dict[str, Any]:
    """The config.json dict behind ctx.cfg (checkpoint dir first, else the preset)."""
    if ctx.checkpoint_dir is not None and (ctx.checkpoint_dir / "config.json").is_file():
        return json.loads((ctx.checkpoint_dir / "config.json").read_text())
    if ctx.preset is None:
        raise ValueError("neither a checkpoint dir with config.json nor a preset: cannot rebuild the HF config")
    return preset_hf_config(ctx.preset)


def reference_model(ctx: Any, dtype: torch.dtype = torch.float32) -> K3Reference:
    """K3Reference(ctx.cfg, dtype) with the checkpoint loaded strictly, on ctx.device, cached per dtype."""
    def build() -> K3Reference:
        ref = K3Reference(ctx.cfg, dtype)
        load_into(ref, ctx.cfg, checkpoint_tensors(ctx))
        return ref.to(ctx.device)
    return _cached(ctx, f"oracle.k3.{str(dtype).removeprefix('torch.')}", build)


def hf_model(ctx: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers' KimiLinearForCausalLM with the same weights (Kimi-Linear configs only)."""
    from k3verify.oracle.hf_kimi_linear import build_hf_model

    def build() -> nn.Module:
        return build_hf_model(ctx.cfg, hf_config_dict(ctx), checkpoint_tensors(ctx), dtype=dtype, device=ctx.device)
    return _cached(ctx, f"oracle.hf.{str(dtype).removeprefix('torch.')}", build)
