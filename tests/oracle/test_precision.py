"""Declared precisions: Q8_0 rounding exactly as llama.cpp's CPU path does it, and the w4a8-q8act emulation of the
routed experts, applied inside `emulated()` only."""

from __future__ import annotations

import pytest
import torch

from k3verify.oracle import active
from k3verify.oracle import functional as Fn
from k3verify.oracle.identify import logprob_distance, logprobs, oracle, prompts
from k3verify.oracle.precision import PRECISIONS, get_precision
from k3verify.presets import get_preset


def test_q8_0_rounds_a_hand_computed_block_half_to_even() -> None:
    """max|x| = 127/64, so the scale is 1/64 and x·127/max|x| = 64x exactly: 1/128 -> 0.5 -> 0, 3/128 -> 1.5 -> 2,
    5/128 -> 2.5 -> 2 (ties to even, as _mm256_round_ps), 0.3 -> 19.2 -> 19; the maximum stays exact."""
    x = torch.zeros(32)
    x[:6] = torch.tensor([127 / 64, 1 / 128, 3 / 128, -3 / 128, 5 / 128, 0.3])
    q = torch.tensor([127, 0, 2, -2, 2, 19], dtype=torch.float32)
    expected = torch.zeros(32)
    expected[:6] = q / 64
    assert torch.equal(Fn.q8_0_round(x), expected)


def test_q8_0_matches_ggml_on_ties_of_the_fp32_product_and_of_the_fp16_scale() -> None:
    """Blocks whose rounding depends on ggml's exact fp32 steps; expected values are what llama.cpp's CPU Q8_0
    quantizer (x86 AVX2 quantize_row_q8_0, then dequantize) returned for these very inputs.

    max|x| = 3: id = fl(127/3) = 42.333332 (one correctly rounded division; reciprocal-then-multiply gives
    42.333336), and fl(x·id) lands exactly on 2.5, 0.5 and 9.5 for the three small values, which round to even
    (2, 0, 10) where the exact products 2.50000007, 0.50000004, 9.4999999 would give 3, 1, 9; d = fp16(3/127).
    max|x| = 127·(1 + 2^-11) and 127·(1 + 3·2^-11): max|x|/127 is exactly an fp16 midpoint, rounded to even
    (d = 1 and 1 + 2^-9), and every value comes back as q·d with that fp16 d."""
    x = torch.zeros(3, 32)
    x[0, :5] = torch.tensor([3.0, 0.05905511975288391, 0.22440944612026215, -0.05905511975288391,
                             0.011811024509370327])
    x[1, :2] = torch.tensor([127.0 * (1 + 2**-11), 1.0])
    x[2, :2] = torch.tensor([-127.0 * (1 + 3 * 2**-11), 1.0])
    d = 1548 / 2**16  # fp16(3/127): 0x260c
    expected = torch.zeros(3, 32)
    expected[0, :5] = torch.tensor([127 * d, 2 * d, 10 * d, -2 * d, 0.0])
    expected[1, :2] = torch.tensor([127.0, 1.0])
    expected[2, :2] = torch.tensor([-127.248046875, 1.001953125])
    assert torch.equal(Fn.q8_0_round(x), expected)
    assert torch.equal(Fn.q8_0_round(x.double()), expected.double())


def test_q8_0_keeps_zero_blocks_and_flattens_small_values_beside_a_huge_one() -> None:
    """A block of zeros stays zero (no 0/0); in a block with 1e4, the scale is fp16(1e4/127) = 78.75, so 1e4 comes
    back as 127·78.75 = 10001.25 and ±1 round to 0; the next block keeps its own scale (and ties to even)."""
    x = torch.zeros(3, 32)
    x[1, 0], x[1, 1], x[1, 2] = 1e4, 1.0, -1.0
    x[2, :2] = torch.tensor([0.5, 0.25])
    out = Fn.q8_0_round(x)
    assert torch.equal(out[0], torch.zeros(32)) and not torch.isnan(out).any()
    expected = torch.zeros(32)
    expected[0] = 10001.25
    assert torch.equal(out[1], expected)
    scale = torch.tensor(0.5 / 127).half().float()  # 0.25 · 127/0.5 = 63.5 exactly: a tie, to even 64
    assert torch.equal(out[2, :2], torch.tensor([127.0, 64.0]) * scale)


def test_q8_0_blocks_run_along_the_last_dim_and_refuse_partial_blocks() -> None:
    """Each row is cut into blocks of 32 (a value in block 2 does not scale block 1); a width that is not a multiple
    of 32 raises naming it; the input dtype is kept."""
    x = torch.full((2, 64), 0.01, dtype=torch.float64)
    x[0, 40] = 100.0
    out = Fn.q8_0_round(x)
    assert out.dtype == torch.float64
    assert torch.equal(out[0, :32], out[1, :32]) and float(out[0, 41]) == 0.0
    with pytest.raises(ValueError, match="got a row of 48 values"):
        Fn.q8_0_round(torch.ones(48))


def test_precisions_declare_base_and_gold_dtypes() -> None:
    """Plain dtypes have gold one step up; the emulated ones run fp32 against fp64; unknown names list the known."""
    assert {n: (p.dtype, p.gold_dtype) for n, p in PRECISIONS.items()} == {
        "bfloat16": (torch.bfloat16, torch.float32), "float16": (torch.float16, torch.float32),
        "float32": (torch.float32, torch.float64), "w4a8-q8act": (torch.float32, torch.float64),
        "w-gguf-a8": (torch.float32, torch.float64)}
    with pytest.raises(KeyError, match="unknown precision 'bf16'; known: bfloat16, float16, float32, w4a8-q8act, "
                                       "w-gguf-a8"):
        get_precision("bf16")


def test_w4a8_expert_rounds_every_matmul_input_to_q8_0() -> None:
    """Inside w4a8-q8act, a routed expert computes w2·q8(situ(w1·q8(x), w3·q8(x))): the gate/up input and the down
    input are rounded, weights are the dequantized MXFP4 ones; outside, the exact expert."""
    preset = "k3-tp4"
    expert = oracle(preset, torch.float32).model.layers[1].block_sparse_moe.experts[0]
    x = torch.randn(5, expert.w1.weight.shape[1], generator=torch.Generator().manual_seed(1))
    exact = expert(x)
    with get_precision("w4a8-q8act").emulated():
        emulated = expert(x)
    h = Fn.situ(Fn.linear(Fn.q8_0_round(x), expert.w1.weight), Fn.linear(Fn.q8_0_round(x), expert.w3.weight),
                expert.beta, expert.linear_beta)
    assert torch.equal(emulated, Fn.linear(Fn.q8_0_round(h), expert.w2.weight))
    assert not torch.equal(emulated, exact) and torch.equal(expert(x), exact)


def test_w4a8_emulation_moves_the_model_and_plain_dtypes_emulate_nothing() -> None:
    """On k3-tp4 the emulated fp32 oracle is farther from the fp64 gold than plain fp32 (by orders of magnitude),
    the plain precisions set no knob, and leaving the block restores the oracle bit for bit."""
    preset = "k3-tp4"
    ids = prompts(get_preset(preset), n=1)
    f32, f64 = logprobs(preset, torch.float32, ids), logprobs(preset, torch.float64, ids)
    with get_precision("w4a8-q8act").emulated():
        assert active.active() == {"moe.expert_activations": "q8_0"}
        emulated = logprobs(preset, torch.float32, ids)
    assert logprob_distance(f64, emulated) > 100 * logprob_distance(f64, f32)
    assert torch.equal(logprobs(preset, torch.float32, ids)[0], f32[0])
    for name in ("bfloat16", "float16", "float32"):
        with get_precision(name).emulated():
            assert active.active() == {}
