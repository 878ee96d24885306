"""Shared pytest set-up: GPU tests are skipped with a printed reason when CUDA is absent, and every
test runs with one torch thread (the models are tiny: on the shared 2-core runner two spinning
OpenMP threads make each small fp32 GEMM ~20 ms instead of ~10 us)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture
def cuda_moe_combine() -> Iterator[None]:
    """Route the MoE combine to its CUDA implementation (bf16 grouped GEMMs, fp32 per-pair gather) on CPU, as
    dispatch picks it on the GPU."""
    from k3verify.kernels.moe import COMBINE
    from k3verify.kernels.registry import CUDA, REGISTRY

    REGISTRY.force(COMBINE, CUDA)
    yield
    REGISTRY.force(COMBINE, None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no GPU on this machine (run on the H200 with `pytest -m gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
