"""llama.cpp's CPU arithmetic for GGUF weights (oracle/gguf_arith.py): the Q8_K rounding rules, absorbed MLA, the
knob, the refused types. (Bit-for-bit agreement with ggml's own quantizers: tests/peers/test_gguf_quant.py.)"""

from __future__ import annotations

import pytest
import torch

from k3verify.oracle import active, gguf_arith
from k3verify.oracle import functional as Fn

ON = {gguf_arith.KNOB: "on"}


def test_q8_k_keeps_the_sign_of_the_first_largest_value_and_rounds_half_to_even() -> None:
    """ggml scales by -127/max with max the first value of largest magnitude, sign kept: a block led by -2.0 (and
    +2.0 later) has iscale 63.5 and codes -127 and 127 at those places; 1/127 of the peak times 0.5 lands on a
    tie (x·iscale = ±0.5 exactly) and rounds to even (0); d = 1/iscale."""
    x = torch.zeros(256)
    x[3], x[10], x[11], x[12] = -2.0, 2.0, -1 / 127, 3 / 127  # products -0.5 and 1.5 exactly
    q, d = gguf_arith.q8_k_codes(x)
    iscale = torch.tensor(-127.0) / torch.tensor(-2.0)
    assert float(d) == float(torch.tensor(1.0) / iscale)
    assert q[0, 3] == -127 and q[0, 10] == 127 and q[0, 11] == 0 and q[0, 12] == 2  # half to even: -0.5 -> 0, 1.5 -> 2
    flipped = -x  # now +2.0 comes first: iscale negative, the same magnitudes
    q2, d2 = gguf_arith.q8_k_codes(flipped)
    assert float(d2) == -float(d) and torch.equal(q2, q)


def test_a_zero_block_stays_zero_and_rows_must_be_whole_blocks() -> None:
    assert torch.equal(gguf_arith.q8_k_round(torch.zeros(2, 512)), torch.zeros(2, 512))
    with pytest.raises(ValueError, match="blocks of 256; got a row of 96"):
        gguf_arith.q8_k_codes(torch.ones(96))


def test_types_the_oracle_cannot_multiply_are_refused_by_name() -> None:
    for kind in ("Q4_1", "Q5_1", "Q8_K", "I32"):
        with pytest.raises(gguf_arith.UnsupportedWeightType, match=f"ggml type {kind}:"):
            gguf_arith.activation_format(kind)
    assert gguf_arith.activation_format("Q4_K") == "q8_K" and gguf_arith.activation_format("Q5_0") == "q8_0"
    assert gguf_arith.activation_format("F16") == "f16"


def test_a_tagged_weight_rounds_its_input_only_while_the_knob_is_on() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g), torch.nn.Parameter(torch.randn(8, 64, generator=g), requires_grad=False)
    exact = Fn.linear(x, w)
    setattr(w, gguf_arith.TAG, "q8_0")
    assert torch.equal(Fn.linear(x, w), exact)
    with active.overriding(ON):
        rounded = Fn.linear(x, w)
    assert torch.equal(rounded, Fn.q8_0_round(x) @ w.t()) and not torch.equal(rounded, exact)


def _mla_weights(g: torch.Generator, heads: int = 2, nope: int = 32, rope: int = 8, v: int = 16, lora: int = 32,
                 hidden: int = 64) -> dict[str, torch.Tensor]:
    def p(*shape: int) -> torch.Tensor:
        return torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64) * 0.2, requires_grad=False)

    return {"q_proj": p(heads * (nope + rope), hidden), "kv_a_proj": p(lora + rope, hidden),
            "kv_a_norm": p(lora) + 1, "kv_b_proj": p(heads * (nope + v), lora), "o_proj": p(hidden, heads * v)}


def test_absorbed_mla_is_the_same_function_and_rounds_where_llama_cpp_does() -> None:
    """With every weight tagged F32 (nothing rounded), absorbed MLA equals the plain one in fp64 to rounding; with
    v_b tagged F16 (the latent attention output rounded to fp16 before v_b) it moves by about fp16's step."""
    g = torch.Generator().manual_seed(1)
    w = _mla_weights(g)
    x = torch.randn(7, 64, generator=g, dtype=torch.float64)
    kw = dict(heads=2, qk_nope=32, qk_rope=8, v_dim=16, kv_lora_rank=32)
    plain = Fn.mla(x, **kw, **w)  # type: ignore[arg-type]
    for name, weight in w.items():
        setattr(weight, gguf_arith.TAG, {"k_b": "f32", "v_b": "f32"} if name == "kv_b_proj" else "f32")
    with active.overriding(ON):
        absorbed = Fn.mla(x, **kw, **w)  # type: ignore[arg-type]
        setattr(w["kv_b_proj"], gguf_arith.TAG, {"k_b": "f32", "v_b": "f16"})
        half = Fn.mla(x, **kw, **w)  # type: ignore[arg-type]
    assert (absorbed - plain).abs().max() < 1e-12 * plain.abs().max()
    moved = float((half - plain).abs().max() / plain.abs().max())
    assert 1e-5 < moved < 1e-2, moved


def test_code_pinning_takes_the_recorded_code_only_at_a_near_tie() -> None:
    """A run recorded inside a pinning block; a second run whose scaled products differ by 2e-5 code steps across
    a rounding boundary at one element takes the recorded code there (one pin), while an element moved by 0.2
    code steps across another boundary keeps its own code: a real difference is never pinned. A rounding with no
    recorded counterpart of its shape is left alone and counted."""
    d = 1 / 63.5  # the peak -2.0 gives iscale 63.5 exactly: scaled = x · 63.5

    def row(tie: float, far: float) -> torch.Tensor:
        x = torch.zeros(256, dtype=torch.float64)
        x[0], x[5], x[6] = -2.0, tie * d, far * d
        return x

    recorded = gguf_arith.CodePins()
    with gguf_arith.pinning_codes(recorded):
        mine = gguf_arith.round_activation(row(10.5 - 1e-5, 20.4), "q8_K")
    assert recorded.pinned == 0 and len(recorded.scaled) == 1
    assert torch.round(mine[5] / d) == 10 and torch.round(mine[6] / d) == 20
    follower = gguf_arith.CodePins(follow=recorded.scaled)
    with gguf_arith.pinning_codes(follower):
        theirs = gguf_arith.round_activation(row(10.5 + 1e-5, 20.6), "q8_K")
        gguf_arith.round_activation(torch.ones(2, 256), "q8_K")
    assert follower.pinned == 1 and follower.unmatched == 1
    assert torch.round(theirs[5] / d) == 10 and torch.round(theirs[6] / d) == 21
    unpinned = gguf_arith.round_activation(row(10.5 + 1e-5, 20.6), "q8_K")
    assert torch.round(unpinned[5] / d) == 11
    with pytest.raises(ValueError, match="needs a recorded run first"), \
            gguf_arith.pinning_codes(gguf_arith.CodePins(follow=[])):
        pass


def test_a_row_rounded_again_takes_the_same_pinned_code_and_counts_once() -> None:
    """The same activation rows rounded for two products (as q, k and v of one input are, or an expert's gate and
    up) take the recorded code at the same near-tie in both, and the pin is counted once: llama.cpp rounds each
    product's input the same way, so it is one choice, not two."""
    d = 1 / 63.5
    x = torch.zeros(3, 256, dtype=torch.float64)
    x[:, 0] = -2.0
    x[1, 5] = (10.5 - 1e-5) * d
    recorded = gguf_arith.CodePins()
    with gguf_arith.pinning_codes(recorded):
        gguf_arith.round_activation(x, "q8_K")
        gguf_arith.round_activation(x, "q8_K")
    moved = x.clone()
    moved[1, 5] = (10.5 + 1e-5) * d
    follower = gguf_arith.CodePins(follow=recorded.scaled)
    with gguf_arith.pinning_codes(follower):
        first = gguf_arith.round_activation(moved, "q8_K")
        again = gguf_arith.round_activation(moved, "q8_K")
    assert torch.equal(first, again) and torch.round(first[1, 5] / d) == 10
    assert follower.pins == [(0, 1, 5)]


def test_a_q8_0_block_scale_at_an_fp16_near_tie_is_pinned() -> None:
    """A Q8_0 block's scale fp16(max|x|/127) whose max sits a hair either side of an fp16 rounding boundary in the
    two runs: the follower takes the recorded run's scale (every value of the block moves with it), counted as a
    pin at the block's scale (element K + block); a scale moved by a whole fp16 step is never pinned."""
    step = 2.0 ** -10 * 2.0 ** -10  # fp16's step for values in [2^-10, 2^-9)
    tie = (2.0 ** -10 + 100.5 * step) * 127  # max|x| / 127 exactly half-way between two fp16 values

    def block(peak: float) -> torch.Tensor:
        x = torch.linspace(-0.1, 0.1, 32, dtype=torch.float64) * peak
        x[3] = peak
        return x[None, :]

    recorded = gguf_arith.CodePins()
    with gguf_arith.pinning_codes(recorded):
        mine = gguf_arith.round_activation(block(tie * (1 - 1e-7)), "q8_0")
        gguf_arith.round_activation(block(tie * (1 + 1e-2)), "q8_0")
    follower = gguf_arith.CodePins(follow=recorded.scaled)
    with gguf_arith.pinning_codes(follower):
        theirs = gguf_arith.round_activation(block(tie * (1 + 1e-7)), "q8_0")
        far = gguf_arith.round_activation(block(tie * (1 + 1.02e-2)), "q8_0")
    unpinned = gguf_arith.round_activation(block(tie * (1 + 1e-7)), "q8_0")
    assert float(mine[0, 3] / theirs[0, 3]) == 1.0 and float(unpinned[0, 3] / theirs[0, 3]) != 1.0
    assert follower.pins == [(0, 0, 32)]
    assert torch.equal(far, gguf_arith.round_activation(block(tie * (1 + 1.02e-2)), "q8_0"))
