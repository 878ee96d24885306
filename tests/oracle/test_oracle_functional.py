"""The reference's formulas against independent hand-written ones, on inputs chosen so bugs show."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from k3verify.oracle import functional as Fn

BETA, BETA_LIN = 4.0, 25.0


def _situ_by_hand(g: float, u: float) -> float:
    """SiTU written with math: β·tanh(g/β)/(1 + e^−g) · β_lin·tanh(u/β_lin)."""
    return BETA * math.tanh(g / BETA) / (1.0 + math.exp(-g)) * BETA_LIN * math.tanh(u / BETA_LIN)


def test_situ_matches_hand_formula_on_grid_with_both_caps_engaged() -> None:
    """SiTU on a 121×121 grid over [−30, 30]² equals the math formula; both tanh caps matter there."""
    axis = torch.linspace(-30.0, 30.0, 121, dtype=torch.float64)
    g, u = torch.meshgrid(axis, axis, indexing="ij")
    expected = torch.tensor([[_situ_by_hand(a, b) for b in axis.tolist()] for a in axis.tolist()],
                            dtype=torch.float64)
    got = Fn.situ(g.float(), u.float(), BETA, BETA_LIN).double()
    scale = expected.abs().max()
    assert float((got - expected).abs().max() / scale) < 1e-6
    # Both caps visibly engaged: dropping either one moves the result by a large fraction of its range.
    no_gate_cap = (F.silu(g) * BETA_LIN * torch.tanh(u / BETA_LIN) - expected).abs().max() / scale
    no_lin_cap = (Fn.situ(g, u, BETA, None) - expected).abs().max() / scale
    silu_glu = (F.silu(g) * u - expected).abs().max() / scale
    assert float(no_gate_cap) > 0.5 and float(no_lin_cap) > 0.2 and float(silu_glu) > 1.0


def test_situ_casts_back_to_input_dtype() -> None:
    """bf16 in, bf16 out (computed in fp32 inside)."""
    g = torch.linspace(-30, 30, 64).to(torch.bfloat16)
    assert Fn.situ(g, g, BETA, BETA_LIN).dtype == torch.bfloat16


def _mix_by_hand(p: list[float], b0: list[float], norm_w: list[float], proj_w: list[float],
                 eps: float) -> list[float]:
    def rsqrt_mean_sq(v: list[float]) -> float:
        return 1.0 / math.sqrt(sum(x * x for x in v) / len(v) + eps)

    q = [n * w for n, w in zip(norm_w, proj_w, strict=True)]
    scores = [sum(x * rsqrt_mean_sq(v) * qi for x, qi in zip(v, q, strict=True)) for v in (b0, p)]
    m = max(scores)
    e = [math.exp(s - m) for s in scores]
    alpha = [x / sum(e) for x in e]
    return [alpha[0] * x0 + alpha[1] * x1 for x0, x1 in zip(b0, p, strict=True)]


def test_attn_res_mix_two_sources_by_hand() -> None:
    """mix(p, [B0]) with H=3 equals the hand computation: raw V mixed, K only scores, no 1/√d."""
    p, b0 = [1.0, -2.0, 0.5], [3.0, 4.0, -1.0]
    norm_w, proj_w, eps = [1.0, 2.0, 0.5], [0.7, -0.25, 1.5], 1e-5
    expected = torch.tensor(_mix_by_hand(p, b0, norm_w, proj_w, eps), dtype=torch.float64)
    got = Fn.attn_res_mix(torch.tensor([p]), [torch.tensor([b0])], torch.tensor(norm_w), torch.tensor([proj_w]), eps)
    assert got.shape == (1, 3) and got.dtype == torch.float32
    assert torch.allclose(got[0].double(), expected, rtol=1e-6, atol=1e-7)
    # The example can tell the classic mistakes apart: a 1/√d score scale gives a different answer.
    scaled = _mix_by_hand(p, b0, [n / math.sqrt(3) for n in norm_w], proj_w, eps)
    assert (torch.tensor(scaled, dtype=torch.float64) - expected).abs().max() > 1e-2


def test_attn_res_mix_with_no_blocks_is_identity() -> None:
    """With B empty the softmax has one source: mix(p, []) == p exactly."""
    p = torch.randn(5, 8)
    assert torch.equal(Fn.attn_res_mix(p, [], torch.ones(8), torch.ones(1, 8), 1e-5), p)


def _router_setup(scores: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """x and an identity router weight such that sigmoid(x·Wᵀ) equals `scores` (fp32 logits)."""
    s = torch.tensor(scores, dtype=torch.float64)
    return torch.logit(s).float(), torch.eye(s.shape[1])


def test_router_correction_bias_flips_a_near_tie_and_weights_stay_uncorrected() -> None:
    """Adversarial near-tie (scores 1e-6 apart): the bias decides the selection, weights use raw s."""
    x, w = _router_setup([[0.70, 0.600001, 0.600000, 0.1]])
    zero = torch.zeros(4)
    bias = torch.tensor([0.0, 0.0, 1e-4, 0.0])
    _, idx_nobias = Fn.router(x, w, zero, 2, 1, 1, True, 1.0)
    weights, idx = Fn.router(x, w, bias, 2, 1, 1, True, 2.5)
    assert idx_nobias.tolist() == [[0, 1]] and idx.tolist() == [[0, 2]]
    s = torch.sigmoid(x.double() @ w.double().t())[0]
    expected = torch.stack([s[0], s[2]]) / (s[0] + s[2]) * 2.5  # uncorrected s, renormalized, scaled
    assert torch.allclose(weights[0].double(), expected, rtol=1e-6)
    assert weights.dtype == torch.float32 and idx.dtype == torch.int64


def test_router_renormalization_changes_weights_and_respects_top1() -> None:
    """moe_renormalize divides by the sum (+1e-20) when top_k > 1; top_k = 1 keeps the raw score."""
    x, w = _router_setup([[0.9, 0.3, 0.2, 0.8], [0.1, 0.55, 0.5, 0.2]])
    zero = torch.zeros(4)
    renorm, idx = Fn.router(x, w, zero, 2, 1, 1, True, 1.0)
    raw, idx_raw = Fn.router(x, w, zero, 2, 1, 1, False, 1.0)
    assert torch.equal(idx, idx_raw) and idx.tolist() == [[0, 3], [1, 2]]
    assert torch.allclose(renorm.sum(-1), torch.ones(2)) and not torch.allclose(raw.sum(-1), torch.ones(2))
    top1, _ = Fn.router(x, w, zero, 1, 1, 1, True, 1.0)
    assert torch.allclose(top1[:, 0], torch.tensor([0.9, 0.55]))


def test_router_grouped_topk_drops_experts_of_losing_groups() -> None:
    """4 groups of 2, keep 2 groups: a lone high score in a weak group loses to a strong pair."""
    x, w = _router_setup([[0.95, 0.05, 0.6, 0.6, 0.7, 0.69, 0.1, 0.1]])
    zero = torch.zeros(8)
    _, flat = Fn.router(x, w, zero, 2, 1, 1, True, 1.0)
    _, grouped = Fn.router(x, w, zero, 2, 4, 2, True, 1.0)
    assert flat.tolist() == [[0, 4]] and grouped.tolist() == [[4, 5]]


def test_router_indices_sorted_ascending_per_token() -> None:
    """Two implementations compare slot by slot only if each token's experts are in ascending order."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 16, generator=gen), torch.randn(12, 16, generator=gen)
    _, idx = Fn.router(x, w, torch.zeros(12), 4, 1, 1, True, 1.0)
    assert torch.equal(idx, idx.sort(dim=-1).values) and bool((idx.diff(dim=-1) > 0).all())


def test_causal_conv_matches_conv1d_with_left_zero_pad() -> None:
    """Per-tap causal conv equals F.conv1d with a left zero pad of W−1; only the first W−1 rows see the pad."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 6, generator=gen, dtype=torch.float64)
    wt = torch.randn(6, 1, 4, generator=gen, dtype=torch.float64)
    expected = F.silu(F.conv1d(F.pad(x.t()[None], (3, 0)), wt, groups=6)[0].t())
    assert torch.allclose(Fn.causal_conv(x, wt), expected, rtol=1e-12, atol=1e-12)
    prefix = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    joined = Fn.causal_conv(torch.cat([prefix, x]), wt)[5:]
    assert torch.allclose(joined[3:], Fn.causal_conv(x, wt)[3:], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(joined[:3], Fn.causal_conv(x, wt)[:3])


def test_l2norm_uses_plus_eps_inside_the_sqrt() -> None:
    """x / sqrt(sum x² + 1e-6): at tiny norms this differs from F.normalize's max(‖x‖, eps)."""
    x = torch.full((1, 4), 1e-4)
    assert torch.allclose(Fn.l2norm(x), x / math.sqrt(4e-8 + 1e-6))
    assert not torch.allclose(Fn.l2norm(x), F.normalize(x, dim=-1))
