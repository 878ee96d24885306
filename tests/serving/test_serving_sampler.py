"""The counter-based sampler: greedy = argmax, draws follow softmax(z/T) within top-k/top-p, a seeded row draws
the same whatever shares its batch, and no parameter in range can overflow it."""

from __future__ import annotations

import math

import pytest
import torch

from k3verify.serving.sampler import (
    MAX_TOP_K,
    SamplingParams,
    nonfinite_mask,
    request_seed,
    sample_tokens,
    uniform_noise,
)

N_DRAWS = 6000


def draws(row: torch.Tensor, params: SamplingParams, n: int = N_DRAWS, seed: int = 7) -> torch.Tensor:
    """n tokens for one logit row: the row repeated at n consecutive positions of one seeded request."""
    logits = row[None].expand(n, -1)
    seeds = torch.full((n,), seed, dtype=torch.int64)
    return sample_tokens(logits, [params] * n, seeds, torch.arange(n, dtype=torch.int64))


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed token counts against expected probabilities (over the support)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {(~support & (counts > 0)).nonzero()}"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def lowbias32(x: int) -> int:
    """The 32-bit hash the sampler emulates in int64 torch ops, in plain Python integers."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_noise_equals_the_plain_integer_hash() -> None:
    """uniform_noise is exactly the 32-bit hash chain written with Python ints (no int64 overflow anywhere)."""
    seed, pos, vocab = -(2**63) + 12345, 2**31 + 7, 50
    noise = uniform_noise(torch.tensor([seed]), torch.tensor([pos]), vocab)[0]
    s = seed & (2**64 - 1)
    key = lowbias32(lowbias32((s >> 32) ^ 0x9E3779B9) ^ (s & 0xFFFFFFFF))
    key = lowbias32(key ^ (pos & 0xFFFFFFFF))
    key2 = lowbias32(key ^ 0x85EBCA6B)
    want = [((lowbias32(lowbias32((key + v) & 0xFFFFFFFF) ^ key2) >> 9) * 2 + 1) / 2**24 for v in range(vocab)]
    assert noise.tolist() == want
    extremes = torch.tensor([0, 2**23 - 1]) * 2 + 1  # the smallest and largest bit patterns
    assert extremes.float().mul(2.0**-24).tolist() == [2.0**-24, 1 - 2.0**-24]  # exact: never 0 or 1


def test_greedy_rows_are_argmax() -> None:
    """temperature 0 and top_k 1 are an argmax, also when sampled rows share the batch."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(max_tokens=1, temperature=0.0), SamplingParams(max_tokens=1, top_k=1),
              SamplingParams(max_tokens=1, temperature=1.5), SamplingParams(max_tokens=1, temperature=0.0)]
    out = sample_tokens(logits, params, torch.arange(4), torch.zeros(4, dtype=torch.int64))
    assert out.dtype == torch.int64 and out.shape == (4,)
    assert [out[i].item() for i in (0, 1, 3)] == [logits[i].argmax().item() for i in (0, 1, 3)]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_draws_follow_the_tempered_softmax(temperature: float) -> None:
    """Token frequencies over many positions match softmax(z / T) (chi-square, 7 dof, p ~ 1e-4 bound)."""
    row = torch.tensor([0.0, 1.0, -0.5, 2.0, 0.3, -2.0, 1.2, 0.7])
    tokens = draws(row, SamplingParams(max_tokens=1, temperature=temperature))
    assert chi_square(tokens, torch.softmax(row / temperature, -1)) < 30.0


def test_a_temperature_ignoring_sampler_would_be_caught() -> None:
    """Control for the test above: draws at T=0.5 are far from softmax(z) at T=1 (the statistic has power)."""
    row = torch.tensor([0.0, 1.0, -0.5, 2.0, 0.3, -2.0, 1.2, 0.7])
    tokens = draws(row, SamplingParams(max_tokens=1, temperature=0.5))
    assert chi_square(tokens, torch.softmax(row, -1)) > 300.0


def test_top_k_draws_only_from_the_k_largest() -> None:
    """top_k restricts draws to the k largest logits, renormalised."""
    row = torch.randn(40, generator=torch.Generator().manual_seed(1))
    tokens = draws(row, SamplingParams(max_tokens=1, top_k=5, temperature=1.0))
    keep = torch.topk(row, 5).indices
    probs = torch.zeros(40)
    probs[keep] = torch.softmax(row[keep], -1)
    assert chi_square(tokens, probs) < 25.0
    assert set(tokens.unique().tolist()) == set(keep.tolist())


@pytest.mark.parametrize(("top_p", "kept"), [(0.5, 1), (0.8, 2), (0.81, 3), (0.95, 3), (0.96, 4), (1.0, 4)])
def test_top_p_keeps_smallest_nucleus(top_p: float, kept: int) -> None:
    """top_p keeps the fewest most-likely tokens whose mass reaches top_p (probs .5 .3 .15 .05)."""
    row = torch.log(torch.tensor([0.15, 0.5, 0.05, 0.3]))
    tokens = draws(row, SamplingParams(max_tokens=1, top_p=top_p), n=3000)
    assert len(tokens.unique()) == kept and 1 in tokens.tolist()


def test_seeded_row_draws_the_same_whatever_shares_its_batch() -> None:
    """Row logits, seed and position fix the token: other rows, their order and the batch size do not matter."""
    gen = torch.Generator().manual_seed(3)
    mine = torch.randn(500, generator=gen)
    p = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.95, top_k=100)
    for position in range(40):
        alone = sample_tokens(mine[None], [p], torch.tensor([99]), torch.tensor([position]))
        others = torch.randn(6, 500, generator=gen)
        batch = torch.cat([others[:3], mine[None], others[3:]])
        params = [SamplingParams(max_tokens=1, temperature=0.3 * (i % 3), top_k=7 * i) for i in range(7)]
        params[3] = p
        crowded = sample_tokens(batch, params, torch.tensor([1, 2, 3, 99, 5, 6, 7]), torch.full((7,), position))
        assert crowded[3] == alone[0]


def test_seed_and_position_change_the_draw() -> None:
    """Another seed or another position gives other draws; the same pair gives the same draw."""
    row = torch.zeros(1000)
    p = SamplingParams(max_tokens=1)
    a, b = draws(row, p, n=64, seed=1), draws(row, p, n=64, seed=2)
    assert torch.equal(a, draws(row, p, n=64, seed=1)) and not torch.equal(a, b)
    assert len(a.unique()) > 50  # positions are not one draw repeated
    assert request_seed(-1) == -1 and request_seed(2**64 - 1) == -1 and request_seed(2**63) == -(2**63)
    assert request_seed(None) != request_seed(None)


@pytest.mark.parametrize("temperature", [1e-30, 1e-7, 5e-324])
def test_tiny_temperature_cannot_overflow(temperature: float) -> None:
    """The poison request of issue 15: a positive temperature far below 1e-6 on large logits is a safe argmax."""
    row = torch.tensor([3e38, -3e38, 1e30, 0.0, 2.9e38])
    out = draws(row, SamplingParams(max_tokens=1, temperature=temperature, top_p=0.9), n=50)
    assert out.tolist() == [0] * 50


def test_extreme_but_finite_logits_sample_finitely() -> None:
    """Rows spanning the whole fp32 range still draw a token from the top of the distribution."""
    row = torch.tensor([3.4e38, -3.4e38, float("-inf"), 3.4e38])
    out = draws(row, SamplingParams(max_tokens=1, temperature=2.0, top_k=3), n=200)
    assert set(out.tolist()) == {0, 3}


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -0.1), ("temperature", 2.5),
    ("temperature", True), ("top_p", 0.0), ("top_p", float("nan")), ("top_p", 1.01), ("top_k", -2),
    ("top_k", MAX_TOP_K + 1), ("top_k", 2.0), ("max_tokens", 0), ("max_tokens", 1 << 40), ("seed", 2**64),
    ("seed", -(2**63) - 1), ("logprobs", 21), ("logprobs", -1), ("stop_token_ids", (-1,)),
    ("stop_token_ids", (2**31,)), ("stop_token_ids", tuple(range(65))),
])
def test_every_sampling_parameter_is_range_checked(field: str, value: object) -> None:
    """Out-of-range, non-finite or wrongly typed values raise ValueError naming the field."""
    with pytest.raises(ValueError, match=field.rstrip("s")[:10]):
        SamplingParams(**({"max_tokens": 4} | {field: value}))  # type: ignore[arg-type]


def test_stop_token_ids_checked_against_the_vocabulary() -> None:
    """An id past the model's vocabulary is refused by check_vocab, naming it."""
    p = SamplingParams(max_tokens=2, stop_token_ids=(5, 4608))
    p.check_vocab(4609)
    with pytest.raises(ValueError, match=r"\[0, 4608\); got \[4608\]"):
        p.check_vocab(4608)


def test_nonfinite_mask_flags_nan_posinf_and_all_masked_rows() -> None:
    """NaN, +inf and a row with no finite value are flagged; -inf alone is a legitimate mask."""
    logits = torch.tensor([[0.0, float("nan")], [float("inf"), 1.0], [float("-inf")] * 2, [float("-inf"), 2.0]])
    assert nonfinite_mask(logits).tolist() == [True, True, True, False]


def test_hash_is_uniform_over_the_vocabulary() -> None:
    """Noise bits are uniform: 64 buckets over 4096 ids x 16 positions stay within a chi-square bound."""
    noise = uniform_noise(torch.arange(16) * 7919, torch.arange(16), 4096).flatten()
    counts = torch.bincount((noise * 64).long(), minlength=64).double()
    expected = noise.numel() / 64
    assert float(((counts - expected) ** 2 / expected).sum()) < 63 + 6 * math.sqrt(2 * 63)
