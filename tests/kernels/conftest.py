"""Kernel tests run tiny GEMMs: one torch thread is as fast, and on a shared 2-core runner two
spinning OpenMP threads make every small fp32 GEMM ~20 ms."""

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
