"""What `bench` holds at its peak, checked against the card before anything is allocated, and the gold it can
afford: transformers' fp32 model whole where it fits beside the bf16 weights, else the K3 reference streamed one
decoder layer at a time (oracle/streamed.py), which the result then says.

The peak of a bench run: the generated bf16 weights (freed once the golds and transformers' baseline are built from
them), then our bf16 model (built from the same weights drawn again one tensor at a time: LazySynthetic) beside the
baseline, and one rank's caches and prefill transients for the workload (plan/memory.py). So the generated weights
and the baseline are never held together with our model: peak = weights + our model, caches and transients.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from k3verify.checkpoint.names import checkpoint_specs
from k3verify.checkpoint.synthetic_weights import synthetic_group
from k3verify.config import ModelConfig
from k3verify.oracle.streamed import StreamedReference
from k3verify.plan.device_fit import GIB, require_fit
from k3verify.plan.memory import PlanRequest, plan


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of every checkpoint tensor of `cfg` held in `dtype` (packed MXFP4 counted as stored)."""
    total = 0
    for spec in checkpoint_specs(cfg).values():
        n = 1
        for d in spec.shape:
            n *= d
        total += n * (spec.dtype.itemsize if not spec.dtype.is_floating_point else dtype.itemsize)
    return total


class LazySynthetic(Mapping[str, torch.Tensor]):
    """The synthetic checkpoint tensors of `cfg`, each drawn on `device` when read (the same values as
    synthetic_tensors: each depends on (seed, name) alone), so loading a model from it holds one tensor at a time."""

    def __init__(self, cfg: ModelConfig, seed: int, device: torch.device) -> None:
        self.cfg, self.seed, self.device = cfg, seed, device
        self.specs = checkpoint_specs(cfg)

    def __getitem__(self, name: str) -> torch.Tensor:
        return synthetic_group(self.cfg, self.specs, [name], self.seed, self.device)[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


@dataclass(frozen=True)
class BenchPeak:
    weights: int  # the generated checkpoint tensors (bf16), or transformers' bf16 baseline, whichever is held
    ours: int  # our model, its caches and transients (plan/memory.py)

    @property
    def total(self) -> int:
        return self.weights + self.ours

    def describe(self) -> str:
        return (f"{self.weights / GIB:.1f} GiB generated weights or transformers' bf16 baseline + "
                f"{self.ours / GIB:.1f} GiB our model, caches and transients")


def bench_peak(cfg: ModelConfig, *, context: int, batch: int, segment: int) -> BenchPeak:
    ours = plan(cfg, PlanRequest(1, 1, context, batch, min(segment, context), torch.bfloat16, "cached"))[0].total
    return BenchPeak(weight_bytes(cfg), ours)


def require_bench_fits(peak: BenchPeak, card_gib: float, what: str = "bench") -> None:
    """DoesNotFit "bench needs X GiB, this card has Y GiB; try ..." before anything is allocated."""
    hint = "a smaller --batch or --prefill, or a card with more memory"
    require_fit(f"{what} ({peak.describe()})", peak.total, card_gib, hint)


GOLD_HEADROOM = 0.9  # the fp32 gold's activations and the allocator's slack: kl-48b-8l's 77.4 GiB on a 79.1 GiB
# H100 ran out of memory


def fp32_whole_fits(cfg: ModelConfig, card_gib: float) -> bool:
    """Whether transformers' fp32 model fits whole beside the generated bf16 weights, with GOLD_HEADROOM."""
    return weight_bytes(cfg, torch.float32) + weight_bytes(cfg) <= GOLD_HEADROOM * card_gib * GIB


def streamed_gold_logits(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], ids: torch.Tensor,
                         device: torch.device) -> tuple[torch.Tensor, str]:
    """fp32 logits [T, V] of the K3 reference run one decoder layer at a time over `tensors`, and its note."""
    ref = StreamedReference(cfg, tensors, torch.float32, device)
    logits = ref(ids.to(device)).logits.float()
    return logits, (f"gold: the K3 reference in fp32, streamed one decoder layer at a time (oracle/streamed.py; "
                    f"{ref.stats.describe()}): transformers' fp32 model would hold "
                    f"{weight_bytes(cfg, torch.float32) / GIB:.1f} GiB beside the weights")
