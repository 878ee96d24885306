"""Serving tests: one torch thread (tiny GEMMs; two spinning OpenMP threads make each ~20 ms on the
shared 2-core runner) and session-cached synthetic models."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache

import pytest
import torch

from k3verify.checkpoint.init import synthetic_tensors
from k3verify.config import ModelConfig
from k3verify.presets import get_preset
from k3verify.serving.model import ServingModel


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


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
