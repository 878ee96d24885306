"""Where each catalogued convention is identifiable: how far applying it moves the oracle's whole-model logprobs,
against the oracle's own precision noise, on a synthetic preset.

The measure is the one an endpoint comparison can make from top-k logprobs: for each position, the reference's top
five tokens; both rows' logprobs at those tokens, each centred on its own mean (a shift common to a row, such as a
normaliser, is not a difference); rel-RMS = RMS(a - b) / RMS(a) over every position of every prompt. The yardstick
is the same distance between the unchanged oracle in fp32 and in fp64 (for a precision entry: bf16 against fp32).
An alternative is identifiable on a preset when it moves the fp32 logprobs by at least IDENTIFIABLE_FACTOR times
the yardstick. `python tools/measure_conventions.py` prints the table docs/conventions.md records.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from k3verify.checkpoint.loader import load_into
from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.config import ModelConfig
from k3verify.oracle.conventions import Assignment, applied
from k3verify.oracle.k3_reference import K3Reference
from k3verify.presets import get_preset

TOP_K = 5
IDENTIFIABLE_FACTOR = 100.0
PROMPTS, PROMPT_LEN = 2, 24


def logprob_distance(reference: list[torch.Tensor], other: list[torch.Tensor], k: int = TOP_K) -> float:
    """rel-RMS of centred top-k logprobs (module docstring); each list holds [T, V] log-softmax rows per prompt."""
    num = den = 0.0
    for ref, oth in zip(reference, other, strict=True):
        top = ref.topk(k, dim=-1).indices
        a, b = ref.gather(-1, top).double(), oth.gather(-1, top).double()
        a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
        num += float((a - b).pow(2).sum())
        den += float(a.pow(2).sum())
    return (num / den) ** 0.5 if den > 0 else float("inf")


def prompts(cfg: ModelConfig, n: int = PROMPTS, length: int = PROMPT_LEN, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (length,), generator=g) for _ in range(n)]


@functools.cache
def _tensors(preset: str) -> dict[str, torch.Tensor]:
    return synthetic_tensors(get_preset(preset), seed=0)


@functools.cache
def oracle(preset: str, dtype: torch.dtype) -> K3Reference:
    """The preset's synthetic checkpoint (seed 0, as `resolve_target` writes it) loaded into K3Reference, cached."""
    cfg = get_preset(preset)
    model = K3Reference(cfg, dtype)
    load_into(model, cfg, _tensors(preset))
    return model


def logprobs(preset: str, dtype: torch.dtype, ids: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp64 log-softmax rows [T, V] of the preset's oracle in `dtype`, under whatever conventions are applied."""
    model = oracle(preset, dtype)
    return [torch.log_softmax(model(x).logits.double(), dim=-1) for x in ids]


@dataclass
class Measurement:
    """One preset: the yardsticks and each alternative's distance from the released oracle (keyed by
    `Assignment.text`), with the logprobs kept for pairwise comparisons."""

    preset: str
    noise_fp32: float
    noise_bf16: float
    effects: dict[str, float] = field(default_factory=dict)
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def identifiable(self, text: str) -> bool:
        return self.effects[text] >= IDENTIFIABLE_FACTOR * self.noise_fp32


def measure(preset: str, alternatives: list[Assignment]) -> Measurement:
    """Distances of `alternatives` (fp32; precision entries in bf16, against the bf16 yardstick) on `preset`."""
    ids = prompts(get_preset(preset))
    f32, f64, bf16 = (logprobs(preset, dt, ids) for dt in (torch.float32, torch.float64, torch.bfloat16))
    out = Measurement(preset, logprob_distance(f64, f32), logprob_distance(f32, bf16))
    for a in alternatives:
        dtype, base = (torch.bfloat16, bf16) if a.convention.precision else (torch.float32, f32)
        with applied([a]):
            out.rows[a.text] = logprobs(preset, dtype, ids)
        out.effects[a.text] = logprob_distance(base, out.rows[a.text])
    return out
