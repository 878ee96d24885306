"""Projections that share an input run as one GEMM over one weight whose row blocks ARE the members' weights:
loading writes through, bf16 runs one GEMM, fp32 stays member by member, a replaced weight is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3verify.serving.layers.fused import FusedLinears
from k3verify.serving.layers.linear import linear


def _members(dtype: torch.dtype) -> list[torch.nn.Linear]:
    return [linear(24, n, dtype, "cpu") for n in (16, 16, 7, 3)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_members_are_blocks_of_the_fused_weight(dtype: torch.dtype) -> None:
    """A weight written in place (as the checkpoint loader does) is what the fused GEMM reads."""
    members = _members(dtype)
    fused = FusedLinears(members)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lin in members:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g).to(dtype))
    assert torch.equal(fused.weight, torch.cat([lin.weight for lin in members]))
    x = torch.randn(5, 24, generator=g).to(dtype)
    outs = fused(x)
    assert [tuple(o.shape) for o in outs] == [(5, 16), (5, 16), (5, 7), (5, 3)]
    for out, lin in zip(outs, members, strict=True):
        if dtype == torch.float32:  # member by member: the unfused linears' bits
            assert torch.equal(out, F.linear(x, lin.weight))
        else:
            torch.testing.assert_close(out, F.linear(x, lin.weight), rtol=1.6e-2, atol=1e-5)
    assert fused.fused == (dtype == torch.bfloat16)


def test_a_replaced_member_weight_is_fused_again() -> None:
    """Re-assigning a member's Parameter (to_empty() then a load, a move) must not leave its block stale: the next
    call fuses again, reads the new values, and the member is a block of the new fused weight."""
    members = _members(torch.bfloat16)
    fused = FusedLinears(members)
    new = torch.randn(members[2].weight.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    members[2].weight = torch.nn.Parameter(new.clone(), requires_grad=False)
    x = torch.randn(2, 24, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = fused(x)[2]
    torch.testing.assert_close(out, F.linear(x, new), rtol=1.6e-2, atol=1e-5)
    assert members[2].weight.data_ptr() == fused.weight[32:39].data_ptr()


def test_members_must_share_the_input() -> None:
    with pytest.raises(ValueError, match="must share input width"):
        FusedLinears([linear(24, 4, torch.bfloat16, "cpu"), linear(12, 4, torch.bfloat16, "cpu")])
