"""kernels/pinned.py: host ints for a device keep their values and dtype; the host side is pinned only for a CUDA
device (a CPU-only build cannot pin), and the device copy is a new tensor, not a view of the host one."""

from __future__ import annotations

import pytest
import torch

from k3verify.kernels.pinned import host_tensor, to_device


def test_host_tensor_for_cpu_is_plain_and_exact() -> None:
    t = host_tensor([[3, -1], [2**40, 0]], torch.device("cpu"))
    assert t.dtype == torch.long and t.tolist() == [[3, -1], [2**40, 0]] and not t.is_pinned()


def test_to_device_keeps_values_and_dtype() -> None:
    t = to_device([0.5, 2.0], torch.device("cpu"), torch.float32)
    assert t.dtype == torch.float32 and t.tolist() == [0.5, 2.0]


@pytest.mark.gpu
def test_cuda_host_side_is_pinned() -> None:
    dev = torch.device("cuda")
    assert host_tensor([1, 2, 3], dev).is_pinned()
    out = to_device([1, 2, 3], dev)
    torch.cuda.synchronize()
    assert out.is_cuda and out.tolist() == [1, 2, 3]
