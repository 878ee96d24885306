"""The shipped KDA score launches, compiled offline for sm_90 (lab/gpu/kernel_regs.py: no GPU needed), stay within
their register cap: four programs fit on an SM, where uncapped builds held 170-200 registers and two fit."""

from __future__ import annotations

import importlib

import pytest

from k3verify.kernels.kda import score_launch as vt


@pytest.mark.parametrize("kind", ["fused", "record"])
def test_shipped_launch_compiles_within_its_register_cap(kind: str) -> None:
    pytest.importorskip("triton")
    regs_tool = importlib.import_module("lab.gpu.kernel_regs")  # imports triton at module level
    launch = vt.FUSED_LAUNCH if kind == "fused" else vt.RECORD_LAUNCH
    assert launch.maxnreg is not None, "the shipped launch has a register cap"
    kernel = regs_tool.compile_kernel(kind, launch, head_dim=128, positions=5, width=4)
    regs, _ = regs_tool.resource_usage(kernel)
    assert regs <= launch.maxnreg, f"{kind}: {regs} registers over the cap {launch.maxnreg}"
    assert regs_tool.programs_per_sm(regs, launch.num_warps, int(kernel.metadata.shared)) >= 4
