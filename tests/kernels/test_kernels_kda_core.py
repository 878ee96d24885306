"""The chunked torch KDA recurrence against the recurrence written as a plain per-head loop."""

from __future__ import annotations

import pytest
import torch

from k3verify.kernels.kda.torch_ref import CHUNK, kda_decode_torch, kda_prefill_torch


def loop_reference(q, k, v, g, beta, cu, s0, scale):  # noqa: ANN001, ANN201 - a test oracle, fp64 in and out
    """S <- diag(exp g) S; S <- S + beta k (v - S^T k)^T; o = S^T (scale q), one head and token at a time."""
    T, H, dk = q.shape
    o = torch.zeros(T, H, v.shape[-1], dtype=torch.float64)
    finals = s0.clone()
    for n in range(len(cu) - 1):
        for h in range(H):
            S = s0[n, h].clone()
            for t in range(cu[n], cu[n + 1]):
                qn = q[t, h] / torch.sqrt((q[t, h] ** 2).sum() + 1e-6)
                kn = k[t, h] / torch.sqrt((k[t, h] ** 2).sum() + 1e-6)
                S = torch.exp(g[t, h])[:, None] * S
                S = S + beta[t, h] * torch.outer(kn, v[t, h] - S.t() @ kn)
                o[t, h] = S.t() @ (scale * qn)
            finals[n, h] = S
    return o, finals


def _inputs(lens: list[int], H: int, dk: int, dv: int, decay: float, dtype: torch.dtype, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x = {
        "q": torch.randn(T, H, dk, generator=g), "k": torch.randn(T, H, dk, generator=g),
        "v": torch.randn(T, H, dv, generator=g), "g": -decay * torch.rand(T, H, dk, generator=g),
        "beta": torch.rand(T, H, generator=g), "s0": torch.randn(len(lens), H, dk, dv, generator=g),
    }
    return {name: t.to(dtype) for name, t in x.items()}, cu


@pytest.mark.parametrize("decay", [5.0, 40.0])  # safe-gate range; a spread past fp64's exp range (pairwise path)
def test_chunked_kda_equals_token_loop_in_fp64(decay: float) -> None:
    """fp64 chunked prefill (ragged chunks, varlen, initial states) equals the token loop to 1e-12."""
    x, cu = _inputs([63, 130, 1, 64], H=2, dk=12, dv=7, decay=decay, dtype=torch.float64)
    o, s = kda_prefill_torch(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, x["s0"], 12**-0.5)
    o_ref, s_ref = loop_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, x["s0"], 12**-0.5)
    assert o.dtype == torch.float64 and s.dtype == torch.float64
    assert (o - o_ref).abs().max() < 1e-12 * max(1.0, o_ref.abs().max().item())
    assert (s - s_ref).abs().max() < 1e-12 * max(1.0, s_ref.abs().max().item())


def test_chunked_kda_fp32_is_close_to_fp64_loop() -> None:
    """fp32 state and products: relative RMS to the fp64 loop below 1e-6 (decays formed in fp64)."""
    x, cu = _inputs([150, 70], H=3, dk=16, dv=16, decay=5.0, dtype=torch.float64)
    o_ref, _ = loop_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, x["s0"], 0.25)
    f = {k: t.float() for k, t in x.items()}
    o, s = kda_prefill_torch(f["q"], f["k"], f["v"], f["g"], f["beta"], cu, f["s0"], 0.25)
    assert s.dtype == torch.float32
    assert ((o.double() - o_ref).norm() / o_ref.norm()).item() < 1e-6


def test_decode_step_equals_one_token_prefill() -> None:
    x, _ = _inputs([1, 1, 1], H=2, dk=8, dv=8, decay=5.0, dtype=torch.float64)
    o1, s1 = kda_decode_torch(x["q"], x["k"], x["v"], x["g"], x["beta"], x["s0"], 0.3)
    o2, s2 = kda_prefill_torch(x["q"], x["k"], x["v"], x["g"], x["beta"], [0, 1, 2, 3], x["s0"], 0.3)
    assert torch.allclose(o1, o2, atol=1e-13) and torch.allclose(s1, s2, atol=1e-13)


def test_state_handoff_at_chunk_boundary_is_bitexact_and_mid_chunk_is_not() -> None:
    """Two calls cut at a multiple of 64 with the fp32 state handed over equal one call bit for bit;
    a cut 32 tokens off the grid regroups the chunks and changes bits."""
    x, _ = _inputs([200], H=2, dk=16, dv=16, decay=5.0, dtype=torch.float32)
    args = ("q", "k", "v", "g", "beta")
    whole, s_whole = kda_prefill_torch(*(x[a] for a in args), [0, 200], x["s0"], 0.25)

    def split(cut: int) -> torch.Tensor:
        o1, s1 = kda_prefill_torch(*(x[a][:cut] for a in args), [0, cut], x["s0"], 0.25)
        o2, _ = kda_prefill_torch(*(x[a][cut:] for a in args), [0, 200 - cut], s1, 0.25)
        return torch.cat([o1, o2])
    assert torch.equal(split(2 * CHUNK), whole)
    assert not torch.equal(split(CHUNK + 32), whole)


def test_fla_varlen_arguments_need_no_host_sync() -> None:
    """fla_launch._varlen: one sequence -> the dense call (no offsets at all); several -> device offsets plus
    cu_seqlens_cpu (fla's chunk indices are derived on the host), the same tensors for every layer of a pass (fla's
    tensor_cache keys on identity) and new ones for another pack."""
    from k3verify.kernels.kda.fla_launch import _varlen

    cpu = torch.device("cpu")
    assert _varlen([0, 1024], cpu) == {}
    a = _varlen([0, 5, 12], cpu)
    assert a["cu_seqlens"].tolist() == [0, 5, 12] and a["cu_seqlens_cpu"].device.type == "cpu"
    assert _varlen([0, 5, 12], cpu) is a, "a second layer of the same pass got new offset tensors"
    b = _varlen([0, 6, 12], cpu)
    assert b is not a and b["cu_seqlens"].tolist() == [0, 6, 12]
