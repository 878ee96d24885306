"""The kernel ops behind one registry (kernels/registry.py).

Importing any module below k3verify.kernels runs this file first, so importing the op packages here registers
every op before the first lookup: the registry itself stays a leaf that imports no op.
"""

from k3verify.kernels import attn, conv, kda, moe, mxfp4, norm, router

__all__ = ["attn", "conv", "kda", "moe", "mxfp4", "norm", "router"]
