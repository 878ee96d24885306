"""Serving tests: session-cached synthetic models (one torch thread comes from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import pytest
import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.config import ModelConfig
from k3verify.presets import get_preset
from k3verify.serving.model import ServingModel


@cache
def preset_tensors(name: str) -> dict[str, torch.Tensor]:
    return synthetic_tensors(get_preset(name), seed=0)


@pytest.fixture
def build_model() -> Callable[..., ServingModel]:
    """build_model(preset, dtype=fp32, **kwargs) -> a freshly loaded ServingModel (weights cached)."""

    def build(name: str, dtype: torch.dtype = torch.float32, **kwargs: object) -> ServingModel:
        cfg: ModelConfig = get_preset(name)
        return ServingModel(cfg, dtype, "cpu", **kwargs).load(preset_tensors(name))  # type: ignore[arg-type]

    return build


@pytest.fixture
def preset_weights() -> Callable[[str], dict[str, torch.Tensor]]:
    """preset_weights(name) -> the preset's synthetic checkpoint tensors (cached; copy before mutating)."""
    return preset_tensors
