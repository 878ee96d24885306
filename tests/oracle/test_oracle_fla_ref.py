"""The fla wrappers: signature probes bite, padding keeps the chunk form exact, kernels refuse CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from k3verify.oracle import fla_ref
from k3verify.oracle import functional as Fn


def _swallowing(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, **kwargs: Any) -> torch.Tensor:
    return q  # an "older fla": accepts anything, computes something else


def test_probe_names_the_parameter_a_catch_all_would_swallow() -> None:
    """Passing A_log to a function that only has **kwargs raises OracleMismatch naming A_log."""
    fla_ref.probe(_swallowing, ["q", "k", "scale"])
    with pytest.raises(fla_ref.OracleMismatch, match="'A_log'"):
        fla_ref.probe(_swallowing, ["q", "k", "A_log"])
    fla_ref.probe(_swallowing, ["A_log"], allowed_via_kwargs=frozenset({"A_log"}))


def test_probe_accepts_the_pinned_fla_naive_signatures() -> None:
    """Every parameter the wrappers pass is declared by fla 0.6.0's naive functions."""
    fla_ref.probe(fla_ref._naive_function("naive_recurrent_kda"),
                  ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state"])
    fla_ref.probe(fla_ref._naive_function("naive_chunk_kda"), ["q", "k", "v", "g", "beta", "scale", "chunk_size"])


def _inputs(T: int, h: int = 2, dk: int = 12, dv: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"q": F.normalize(torch.randn(1, T, h, dk, generator=gen), dim=-1),
            "k": F.normalize(torch.randn(1, T, h, dk, generator=gen), dim=-1),
            "v": torch.randn(1, T, h, dv, generator=gen),
            "g": F.logsigmoid(torch.randn(1, T, h, dk, generator=gen)),
            "beta": torch.sigmoid(torch.randn(1, T, h, generator=gen))}


@pytest.mark.parametrize("T", [1, 63, 65])
def test_naive_chunk_off_grid_matches_recurrent_and_fp64(T: int) -> None:
    """T off the 64 grid: the padded chunk form agrees with fla's recurrent one and our fp64 loop."""
    x = _inputs(T)
    rec, _ = fla_ref.naive_recurrent(**x, scale=12 ** -0.5)
    chunk = fla_ref.naive_chunk(**x, scale=12 ** -0.5)
    gold = Fn.recurrent_kda(*(x[k][0].double() for k in ("q", "k", "v", "g", "beta")), 12 ** -0.5)
    assert chunk.shape == rec.shape == (1, T, 2, 7)
    assert float((chunk[0].double() - gold).norm() / gold.norm()) < 1e-5
    assert float((rec[0].double() - gold).norm() / gold.norm()) < 1e-5
    # the same comparison sees a dropped beta
    wrong = fla_ref.naive_chunk(**{**x, "beta": torch.ones_like(x["beta"])}, scale=12 ** -0.5)
    assert float((wrong[0].double() - gold).norm() / gold.norm()) > 0.1


def test_recurrent_kda_fp64_stays_fp64() -> None:
    """Our fp64 recurrence keeps fp64 (fla's naive rounds everything through fp32)."""
    x = {k: v.double() for k, v in _inputs(5).items()}
    out = Fn.recurrent_kda(*(x[k][0] for k in ("q", "k", "v", "g", "beta")), 0.3)
    fla_out, _ = fla_ref.naive_recurrent(**x, scale=0.3)
    assert out.dtype == torch.float64 and fla_out.dtype == torch.float64
    assert 0 < float((out - fla_out[0]).abs().max()) < 1e-5  # fla's fp32 inside shows as a small difference


@pytest.mark.parametrize("kernel", [fla_ref.chunk_kda, fla_ref.fused_recurrent_kda])
def test_triton_kernels_refuse_cpu_tensors(kernel: Any) -> None:
    """Triton wrappers raise OracleMismatch on CPU instead of silently falling back."""
    x = _inputs(4)
    with pytest.raises(fla_ref.OracleMismatch, match="CUDA"):
        kernel(x["q"], x["k"], x["v"], x["g"], x["beta"])


@pytest.mark.gpu
def test_triton_kernels_match_naive_on_cuda() -> None:
    """chunk_kda and fused_recurrent_kda with in-kernel safe gate and beta sigmoid, two packed
    sequences via cu_seqlens, against fla's naive recurrence per sequence (fp32 inputs)."""
    gen = torch.Generator().manual_seed(0)
    lens, h, d = [37, 70], 2, 64
    T = sum(lens)
    q, k = (F.normalize(torch.randn(1, T, h, d, generator=gen), dim=-1).cuda() for _ in range(2))
    v = torch.randn(1, T, h, d, generator=gen).cuda()
    raw_g = torch.randn(1, T, h, d, generator=gen).cuda()
    raw_b = torch.randn(1, T, h, generator=gen).cuda()
    a_log = torch.log(torch.rand(h, generator=gen) * 15 + 1).cuda()
    dt = (torch.randn(h * d, generator=gen) * 0.3).cuda()
    cu = torch.tensor([0, lens[0], T], device="cuda")
    g = fla_ref.naive_lowerbound_gate(raw_g, a_log, dt, -5.0)
    ref = torch.cat([fla_ref.naive_recurrent(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e],
                                             torch.sigmoid(raw_b[:, s:e]))[0]
                     for s, e in ((0, lens[0]), (lens[0], T))], dim=1)
    opts = dict(A_log=a_log, dt_bias=dt, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                lower_bound=-5.0, cu_seqlens=cu)
    for kernel in (fla_ref.chunk_kda, fla_ref.fused_recurrent_kda):
        out, _ = kernel(q, k, v, raw_g, raw_b, **opts)
        assert float((out - ref).norm() / ref.norm()) < 5e-3, kernel.__name__
