"""The arithmetic precision of the parallel model's sums, in bf16 where it matters (the dist.reduce.fp32 and
dist.moe.bf16 checks; the other dist.* checks run in fp32, where every partial already is fp32).

Two claims are held. Comm.all_reduce sums in fp32 whatever its input's dtype and rounds once: at two ranks a
collective of bf16 values adds them once, and a bf16 collective then rounds exactly as the fp32 one does, so
that is shown in a world of its own of REDUCE_WORLD ranks, where a bf16 ring rounds its running sum at every
hop; the contributions are chosen so that their fp32 sum is exact in any order (bf16 values and fp32 values of
at most 18 significant bits, |x| < 16), hence the fp32 collective must equal the exact sum rounded once, bit for
bit. And the expert-parallel MoE keeps each rank's partial sum in fp32 through the collective and rounds once,
as the single-process combine does: in bf16 the two agree except where reassociated fp32 sums straddle a bf16
rounding boundary, while a partial rounded to bf16 before the collective (a second rounding) moves about half
of the elements by one bf16 ulp.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3verify.gates.shared.patch import patched
from k3verify.serving.parallel.comm import Comm, init_world, leave_world
from k3verify.serving.parallel.launch import spawn_world
from k3verify.serving.parallel.layout import ParallelLayout

REDUCE_WORLD = 4  # a bf16 ring of 4 rounds three running sums: ~1/3 of the elements move (2 ranks: none do)
REDUCE_SIZE = 4096
MOE_TOKENS = 48
QUANTUM = 2.0**-12  # every contribution is a multiple of it, below 16 in magnitude: sums of <= 64 of them are exact


def contributions(rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s hostile inputs: bf16 values (|x| in [2^-5, 16): multiples of QUANTUM) and fp32 values of
    18 significant bits at most, the fp32 ones spread over five binades so that rounding them to bf16 loses bits."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randn(REDUCE_SIZE, generator=g) * 2.0 ** torch.randint(-2, 3, (REDUCE_SIZE,), generator=g)
    x = x.clamp(-15.9, 15.9)
    bf16 = x.to(torch.bfloat16)
    bf16 = torch.where(bf16.abs() < 2.0**-5, torch.full_like(bf16, 2.0**-5), bf16)
    fp32 = torch.round(x / QUANTUM) * QUANTUM
    return {"bf16": bf16, "fp32": fp32}


def exact_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of every rank's contribution in fp64, rounded once to their dtype."""
    return torch.stack([p.double() for p in parts]).sum(dim=0).to(parts[0].dtype)


@contextlib.contextmanager
def bf16_collective(comm: Comm) -> Iterator[None]:
    """Control: the collective runs in bf16 (inputs rounded to bf16, the ring's running sums rounded too)."""
    def reduce(t: torch.Tensor) -> torch.Tensor:
        buf = t.to(torch.bfloat16)
        torch.distributed.all_reduce(buf, group=comm.group)
        return buf.to(t.dtype)

    with patched(comm, "all_reduce", reduce):
        yield


@contextlib.contextmanager
def partials_rounded(comm: Comm, dtype: torch.dtype) -> Iterator[None]:
    """Control: each rank's partial sum rounded to the activation dtype before the (fp32) collective."""
    reduce = comm.all_reduce
    with patched(comm, "all_reduce", lambda t: reduce(t.to(dtype).to(t.dtype))):
        yield


@dataclass(frozen=True)
class ReduceSpec:
    world: int
    seed: int
    out_dir: str


def _reduce_rank(rank: int, init_file: str, spec: ReduceSpec) -> None:
    torch.set_num_threads(1)
    comm = init_world(ParallelLayout(spec.world, spec.world, rank), torch.device("cpu"), init_file)
    try:
        out: dict[str, torch.Tensor] = {}
        for name, t in contributions(rank, spec.seed).items():
            out[name] = comm.all_reduce(t.clone())
            with bf16_collective(comm):
                out[f"control.{name}"] = comm.all_reduce(t.clone())
        torch.save(out, Path(spec.out_dir) / f"rank{rank}.pt")
    finally:
        leave_world(comm)


def run_reduce_world(world: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's Comm.all_reduce (and the bf16 control's) of its contributions, in rank order."""
    with tempfile.TemporaryDirectory(prefix="k3v-reduce-") as out_dir:
        spawn_world(_reduce_rank, world, ReduceSpec(world, seed, out_dir))
        return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]


def moe_inputs(hidden: int, layers: int, seed: int) -> list[torch.Tensor]:
    """One bf16 [MOE_TOKENS, hidden] input per MoE layer (unit-scale rows, as after the layer's norm)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(MOE_TOKENS, hidden, generator=g).to(torch.bfloat16) for _ in range(layers)]


def moe_blocks(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]


@torch.no_grad()
def moe_outputs(model: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each MoE block of `model` on its own input (the single-process model or one rank of a parallel one)."""
    return [block(x) for block, x in zip(moe_blocks(model), inputs, strict=True)]
