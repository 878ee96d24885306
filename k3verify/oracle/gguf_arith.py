"""llama.cpp's CPU arithmetic for GGUF weights, as the oracle reproduces it (the `w-gguf-a8` precision).

ggml multiplies a weight stored as ggml type W by an fp32 activation row by first converting the row to W's
"vec_dot type" (ggml-cpu's type traits), then taking the dot product of the two block formats. The oracle does
the same: the activation is rounded to that format bit for bit as ggml's quantizer rounds it, then multiplied by
the dequantized weight exactly (fp32 in the base run, fp64 in the gold run; ggml sums integer products per
block, so it differs from either only in summation order):

| weight types                                              | activation format                      |
|-----------------------------------------------------------|----------------------------------------|
| F32                                                       | F32 (unchanged)                        |
| F16 / BF16                                                | F16 / BF16 (round to nearest even)     |
| Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4                           | Q8_0: 32 values, fp16 scale max/127    |
| Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ2_*, IQ3_*, IQ1_*, IQ4_XS, TQ1_0, TQ2_0 | Q8_K: 256 values, fp32 scale |

Q4_1 and Q5_1 pair with Q8_1, whose dot product adds an fp16-rounded block sum: not a rounding of the
activation alone, so the oracle refuses them (as any type not in the table), naming the type.

A model's weights are tagged with their format (`tag`); `linear`s of functional.py round their input by the tag
while the knob `linear.gguf_activations` is "on" (the precision sets it), and MLA then runs absorbed as llama.cpp
does (q_nope through k_b, the attention in the latent, its output through v_b), each product with its own
rounding. Untagged weights (a checkpoint, not a GGUF) compute exactly as before.

Code pinning (`CodePins`, `pinning_codes`): a Q8_0 or Q8_K code is a rounding of an fp32 product, and two runs
whose inputs differ by fp32 noise take a product that sits that close to a rounding boundary to different codes.
One such code moves its row by a whole code step (~1e-3 of the row), far beyond the noise that caused it, and the
next rounding of that row flips tens of codes: the two runs then differ by the format's own rounding error. To
tell that cascade from any other difference, one run records its scaled products and another, run inside a
pinning block, takes the recorded run's code wherever its own differs only because of such a near-tie (its
distance from the boundary within twice the two runs' drift there, and that drift under MAX_CODE_DRIFT code
steps), counting each pin: the same rule route pinning applies to router near-ties (gates/shared/route_pin.py).
A Q8_0 block's scale d = fp16(max|x|/127) is a rounding too (one fp16 step moves the whole block ~1e-3, as a code
step does), pinned by the same rule; and a row rounded again for another product (q, k and v of one input, an
expert's gate and up, every expert a token is routed to) is one choice, as in llama.cpp, counted once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from k3verify.oracle import active
from k3verify.oracle import functional as Fn
from k3verify.oracle.rounding import scale_steps

KNOB = "linear.gguf_activations"
TAG = Fn.ACTIVATION_TAG  # the attribute a tagged weight carries: its activation format (or {"k_b":.., "v_b":..})
Q8_K_BLOCK = 256
MAX_CODE_DRIFT = 1e-2  # code steps: the most a rounded product may move between two runs and still be pinned

_Q8_0_WEIGHTS = ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "MXFP4")
_Q8_K_WEIGHTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                 "IQ1_S", "IQ1_M", "IQ4_XS", "TQ1_0", "TQ2_0")
ACTIVATION_OF: dict[str, str] = {"F32": "f32", "F16": "f16", "BF16": "bf16", **{t: "q8_0" for t in _Q8_0_WEIGHTS},
                                 **{t: "q8_K" for t in _Q8_K_WEIGHTS}}


class UnsupportedWeightType(ValueError):
    """A ggml weight type whose CPU dot product the oracle does not reproduce."""


def activation_format(ggml_type: str) -> str:
    try:
        return ACTIVATION_OF[ggml_type]
    except KeyError:
        raise UnsupportedWeightType(
            f"ggml type {ggml_type}: the oracle does not reproduce llama.cpp's CPU dot product for it (it "
            f"reproduces {', '.join(ACTIVATION_OF)}; Q4_1 and Q5_1 add an fp16 block sum of the activation)"
        ) from None


def tag(model: nn.Module, formats: Mapping[str, str | Mapping[str, str]]) -> None:
    """Tag each parameter named in `formats` (model parameter name -> ggml type, or {"k_b": type, "v_b": type}
    for an MLA kv_b_proj) with its activation format. Every name must be a parameter of `model`."""
    params = dict(model.named_parameters())
    for name, kind in formats.items():
        if name not in params:
            raise KeyError(f"{name}: no such parameter in the model to tag with ggml type {kind}")
        fmt = activation_format(kind) if isinstance(kind, str) else {k: activation_format(v) for k, v in kind.items()}
        setattr(params[name], TAG, fmt)


def on() -> bool:
    value = active.current(KNOB, "off")
    if value not in ("off", "on"):
        raise ValueError(f"{KNOB} must be 'off' or 'on'; got {value!r}")
    return value == "on"


def format_of(weight: torch.Tensor) -> str | Mapping[str, str] | None:
    """The activation format `weight` was tagged with while the knob is on, else None."""
    fmt: str | Mapping[str, str] | None = getattr(weight, TAG, None)
    return fmt if fmt is not None and on() else None


def q8_k_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 256) as ggml's `quantize_row_q8_K` rounds it: per block of 256, in fp32,
    max = the first value of largest magnitude (sign kept), iscale = -127/max (one fp32 division),
    q = min(127, round_half_even(iscale · x)) and d = 1/iscale (fp32). Returns codes q [..., K/256, 256] and
    scales d [..., K/256, 1], both fp32; a block of zeros has q = 0, d = 0."""
    _, q, d = q8_k_parts(x)
    return q, d


def q8_k_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q8_k_codes with the scaled products iscale · x before rounding first: (scaled, q, d)."""
    K = x.shape[-1]
    if K % Q8_K_BLOCK:
        raise ValueError(f"Q8_K rounds rows in blocks of {Q8_K_BLOCK}; got a row of {K} values")
    blocks = x.float().reshape(*x.shape[:-1], K // Q8_K_BLOCK, Q8_K_BLOCK)
    at = blocks.abs().argmax(dim=-1, keepdim=True)  # the first index of the largest |x|, as ggml's strict `>`
    peak = blocks.gather(-1, at)
    nonzero = peak != 0
    iscale = torch.where(nonzero, torch.full_like(peak, -127.0) / torch.where(nonzero, peak, 1.0), 0.0)
    scaled = blocks * iscale
    q = torch.round(scaled).clamp(max=127.0)  # nearest_int: fp32 + 1.5·2^23, round half to even
    d = torch.where(nonzero, torch.ones_like(iscale) / torch.where(nonzero, iscale, 1.0), 0.0)
    return scaled, q, d


def q8_k_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded as ggml's Q8_K (q8_k_codes), in x's dtype: q·d."""
    q, d = q8_k_codes(x)
    return _value(q, d, x)


def _value(q: torch.Tensor, d: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """q·d shaped and typed as `like`: exact in an fp64 run, one fp32 rounding otherwise."""
    wide = torch.float64 if like.dtype == torch.float64 else torch.float32
    return (q.to(wide) * d.to(wide)).reshape(like.shape).to(like.dtype)


def round_activation(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x rounded to activation format `fmt` (from fp32, as ggml converts the fp32 row), in x's dtype."""
    if fmt == "f32":
        return x
    if fmt == "f16":
        return x.float().half().to(x.dtype)
    if fmt == "bf16":
        return x.float().bfloat16().to(x.dtype)
    if fmt == "q8_0":
        scaled, q, d = Fn.q8_0_codes(x)
        if not _PINS:
            return _value(q, d, x)
        position, step = scale_steps(x.reshape(-1, x.shape[-1]))  # [R, K/32]: each fp16 scale, in its steps
        q, scale_codes = _pinned(scaled, q, position)
        moved = (scale_codes != position.round()).reshape(d.shape)  # a scale followed: code x step
        d = torch.where(moved, (scale_codes * step).reshape(d.shape).to(d.dtype), d)
        return _value(q, d, x)
    if fmt == "q8_K":
        scaled, q, d = q8_k_parts(x)
        return _value(_pinned(scaled, q)[0] if _PINS else q, d, x)
    raise ValueError(f"unknown activation format {fmt!r}; known: f32, f16, bf16, q8_0, q8_K")


# One rounded value of a forward: (rounding index in call order, row, element of the row), the rounding and row
# being the first of that forward to round these very values (CodePins); a Q8_0 row's elements are its K codes,
# then its K/32 block scales
Spot = tuple[int, int, int]


@dataclass
class CodePins:
    """One run's Q8_0/Q8_K roundings, in call order, each as rows [R, K (+ K/32)], one activation row each: the
    scaled products, then for Q8_0 the block scales' max|x|/127 in units of their fp16 step (rounding.scale_steps:
    fp16's rounding to nearest even is then a rounding to the nearest even integer, with near-ties of its own), in
    `scaled` (float64, always recorded), and per row the (rounding, row) that first rounded the same values in this
    run: llama.cpp rounds a matmul input once per product, the same row the same way for every product
    that reads it, so a code is one choice wherever its row is rounded, and a Spot names it at that first rounding.
    A run made to `follow` a recorded run's scaled products takes that run's code wherever its own differs only
    because of a near-tie (module doc), each such spot listed in `pins` (once, however often its row is rounded); a
    rounding with no recorded counterpart of the same shape (a router choice that differs between the runs) is left
    as computed and counted in `unmatched`."""

    follow: list[torch.Tensor] | None = None
    scaled: list[torch.Tensor] = field(default_factory=list)
    pins: list[Spot] = field(default_factory=list)
    unmatched: int = 0
    _seen: dict[bytes, tuple[int, int]] = field(default_factory=dict, repr=False)

    @property
    def pinned(self) -> int:
        """How many codes were taken from the followed run (each row counted once)."""
        return len(self.pins)


_PINS: list[CodePins] = []


@contextlib.contextmanager
def pinning_codes(pins: CodePins) -> Iterator[CodePins]:
    """Inside, every Q8_0/Q8_K activation rounding is recorded into `pins` and takes the followed run's codes at
    near-ties (module doc). Not thread-safe, like oracle/active.py."""
    if pins.follow is not None and not pins.follow:
        raise ValueError("pinning codes needs a recorded run first (the scaled products of a run recorded inside "
                         "pinning_codes)")
    if pins.scaled:
        raise ValueError("a CodePins records one run: give each run its own")
    _PINS.append(pins)
    try:
        yield pins
    finally:
        _PINS.remove(pins)


def _pinned(scaled: torch.Tensor, q: torch.Tensor,
            scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """In a pinning block: the codes q (shaped as scaled) and, given their positions `scales` [R, K/32], the fp16
    scale codes, each the followed run's where this run's differs from it at a near-tie."""
    pins = _PINS[-1]
    at = len(pins.scaled)
    K = scaled.shape[-2] * scaled.shape[-1]
    rows = scaled.detach().float().reshape(-1, K)  # [R, K]
    values, codes = rows.double(), q.reshape(rows.shape).double()
    if scales is not None:
        values = torch.cat([values, scales.double()], dim=1)  # [R, K + K/32]
        codes = torch.cat([codes, scales.double().round()], dim=1)
    first = [pins._seen.setdefault(row.tobytes(), (at, r)) for r, row in enumerate(values.cpu().numpy())]
    pins.scaled.append(values.clone())
    out = codes.clone(memory_format=torch.contiguous_format)
    if pins.follow is not None:
        if at >= len(pins.follow) or pins.follow[at].shape != values.shape:
            pins.unmatched += 1
        else:
            theirs = pins.follow[at].to(values.device)
            their_codes = torch.round(theirs)
            their_codes[:, :K] = their_codes[:, :K].clamp(max=127.0)
            drift = (theirs - values).abs()
            distance = (values - values.floor() - 0.5).abs()
            pin = (their_codes != out) & (distance <= 2 * drift) & (drift <= MAX_CODE_DRIFT)
            pins.pins += [(at, r, e) for r, e in pin.nonzero().tolist() if first[r] == (at, r)]
            out = torch.where(pin, their_codes, out)
    return out[:, :K].to(q.dtype).reshape(q.shape), out[:, K:]


def linear_input(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp feeds it to a product with `weight` (unchanged unless tagged and the knob is on)."""
    fmt = format_of(weight)
    if fmt is None:
        return x
    if not isinstance(fmt, str):
        raise ValueError("a kv_b_proj tagged for k_b and v_b is multiplied only inside absorbed MLA")
    return round_activation(x, fmt)


def mla_absorbed(x: torch.Tensor, q: torch.Tensor, *, heads: int, qk_nope: int, qk_rope: int, v_dim: int,
                 kv_lora_rank: int, kv_a_proj: torch.Tensor, kv_a_norm: torch.Tensor, kv_b_proj: torch.Tensor,
                 kv_a_eps: float, softmax_in_activation: bool) -> torch.Tensor:
    """MLA after q [T, heads·(nope+rope)], absorbed as llama.cpp's Kimi graph computes it: per head
    q_lat = q_nope · k_b (k_b = kv_b's k rows, q_nope rounded for k_b's type), scores = q_lat · c + q_rot · k_rot
    over the normed latent c, softmax, out_lat = p · c, out = out_lat · v_bᵀ (out_lat rounded for v_b's type).
    Returns the heads' outputs [T, heads·v_dim] (before the output gate and o_proj)."""
    fmt = format_of(kv_b_proj)
    if not isinstance(fmt, Mapping):
        raise ValueError("absorbed MLA needs kv_b_proj tagged with the k_b and v_b formats")
    T = x.shape[0]
    q = q.view(T, heads, qk_nope + qk_rope).transpose(0, 1)  # [h, T, dq]
    q_nope, q_rot = q.split([qk_nope, qk_rope], dim=-1)
    c, k_rot = Fn.linear(x, kv_a_proj).split([kv_lora_rank, qk_rope], dim=-1)
    c = Fn.rms_norm(c, kv_a_norm, kv_a_eps)  # [T, lora]
    kv_b = kv_b_proj.to(x.dtype).view(heads, qk_nope + v_dim, kv_lora_rank)
    k_b, v_b = kv_b.split([qk_nope, v_dim], dim=1)  # [h, nope, lora], [h, v, lora]
    q_lat = round_activation(q_nope, fmt["k_b"]) @ k_b  # [h, T, lora]
    scores = (q_lat @ c.t() + q_rot @ k_rot.t()) * (qk_nope + qk_rope) ** -0.5  # [h, T, T]
    future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    if softmax_in_activation:
        e = (scores - scores.amax(dim=-1, keepdim=True)).exp()
        probs = e / e.sum(dim=-1, keepdim=True)
    else:
        probs = torch.softmax(Fn.hi(scores), dim=-1).to(x.dtype)
    out_lat = probs @ c  # [h, T, lora]
    out = round_activation(out_lat, fmt["v_b"]) @ v_b.transpose(1, 2)  # [h, T, v]
    return out.transpose(0, 1).reshape(T, heads * v_dim)


Fn.GGUF_HOOKS.update(linear_input=linear_input, on=on, mla_absorbed=mla_absorbed)
