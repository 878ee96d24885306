"""The kernel ops behind one registry (kernels/registry.py).

Importing any module below k3verify.kernels runs this file first, so importing the op packages here registers
every op before the first lookup: the registry itself stays a leaf that imports no op.

Files in an op package are named by role: `*_kernel.py` holds Triton kernels (the only modules importing triton),
`*_launch.py` the host side that picks a launch and calls a kernel, `torch_ref.py` / `*_ref.py` the plain-torch
references; any other name is an op composed of those in torch (tests/kernels/test_kernel_file_names.py).
"""

from k3verify.kernels import attn, conv, kda, moe, mxfp4, norm, router

__all__ = ["attn", "conv", "kda", "moe", "mxfp4", "norm", "router"]
