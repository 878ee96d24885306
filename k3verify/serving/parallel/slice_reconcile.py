"""Per-rank slice reconcile: before any rank loads, check every rank's slices against the checkpoint headers.

For each rank (built on the meta device, nothing allocated) and each of its parameters: the source tensor
exists; its stored shape is the shape the unsplit model expects (a tensor stored transposed is named as
such); the slice lies inside it and is exactly the parameter's shape. Across ranks: the slices of a split
tensor tile it exactly (no gap, no overlap), a replicated tensor is held whole, each routed expert by
exactly one rank under expert parallelism; and every checkpoint tensor lands on some rank (or is declared
ignorable). Problems are returned as sentences naming the rank, the parameter and the tensor.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch

from k3verify.checkpoint.names import ignorable_reason, module_specs
from k3verify.checkpoint.reader import CheckpointReader
from k3verify.config import ModelConfig
from k3verify.serving.parallel.comm import Comm
from k3verify.serving.parallel.layout import ParallelLayout
from k3verify.serving.parallel.shards import SliceSpec, shard_specs

Shapes = Mapping[str, tuple[int, ...]]  # checkpoint name -> stored shape


def stored_shapes(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Every tensor's stored shape: from the shard headers for a CheckpointReader (no data read), else by
    looking at each tensor (a name-mapped view of a checkpoint)."""
    if isinstance(tensors, CheckpointReader):
        return {name: entry.shape for name, entry in tensors.entries.items()}
    return {name: tuple(t.shape) for name, t in tensors.items()}


def rank_shapes(cfg: ModelConfig, layout: ParallelLayout) -> dict[str, tuple[int, ...]]:
    """This rank's parameter shapes, from the parallel model built on the meta device."""
    from k3verify.serving.parallel.model import ParallelServingModel

    model = ParallelServingModel(cfg, Comm(layout, planning=True), torch.float32, "meta")
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _check_rank(rank: int, shapes: dict[str, tuple[int, ...]], specs: dict[str, SliceSpec],
                stored: Shapes, expected: Shapes) -> list[str]:
    problems = []
    for name, spec in specs.items():
        where = f"rank {rank}: parameter {name} <- {spec.describe()}"
        found, want = stored.get(spec.source), expected.get(spec.source)
        if found is None:
            problems.append(f"{where}: no such tensor in the checkpoint")
            continue
        if want is not None and found != want:
            kind = "is stored transposed" if found == tuple(reversed(want)) else "has the wrong shape"
            problems.append(f"{where}: {spec.source} {kind}: stored {list(found)}, the model expects {list(want)}")
            continue
        got = list(found)
        if spec.dim is not None:
            if not 0 <= spec.start < spec.stop <= found[spec.dim]:
                problems.append(f"{where}: mis-sliced: [{spec.start}, {spec.stop}) is outside {list(found)}")
                continue
            got[spec.dim] = spec.stop - spec.start
        if tuple(got) != shapes[name]:
            problems.append(f"{where}: mis-sliced: the slice is {got}, the parameter is {list(shapes[name])}")
    return problems


def cover_size(cfg: ModelConfig, source: str, dim: int, stored: Shapes) -> int:
    """How far a split tensor's slices must reach: its length, except K3's A_log, padded past the heads."""
    if cfg.is_k3 and source.endswith(".self_attn.A_log"):
        return cfg.kda_num_heads
    return stored[source][dim]


def _check_cover(cfg: ModelConfig, layout: ParallelLayout, held: dict[str, list[tuple[int, SliceSpec]]],
                 stored: Shapes) -> list[str]:
    problems = []
    for source, pieces in held.items():
        if source not in stored:
            continue  # named per rank already
        whole = [r for r, s in pieces if s.dim is None]
        if whole and len(whole) != len(pieces):
            problems.append(f"{source}: ranks {whole} hold it whole while others hold slices")
            continue
        if whole:
            expert = ".experts." in source
            if expert and layout.ep > 1 and len(whole) != 1:
                problems.append(f"{source}: routed expert held by ranks {whole}; expert parallelism needs exactly one")
            elif not expert and len(whole) != layout.world:
                problems.append(f"{source}: replicated tensor held by ranks {whole} only, not by all {layout.world}")
            continue
        ranges = sorted((s.start, s.stop, r) for r, s in pieces)
        cursor, size = 0, cover_size(cfg, source, pieces[0][1].dim or 0, stored)
        for start, stop, r in ranges:
            if start != cursor:
                problems.append(f"{source}: mis-sliced: rank {r} starts at {start}, the slice before ends at {cursor}")
            cursor = stop
        if cursor != size:
            problems.append(f"{source}: mis-sliced: the slices end at {cursor}, the tensor is {size} long")
    return problems


def reconcile_slices(cfg: ModelConfig, layout: ParallelLayout, stored: Shapes) -> list[str]:
    """Every problem with loading a checkpoint whose tensors have `stored` shapes under `layout` (empty: ok)."""
    expected = {cfg.checkpoint_prefix + k: v.shape for k, v in module_specs(cfg).items()}
    problems: list[str] = []
    held: dict[str, list[tuple[int, SliceSpec]]] = defaultdict(list)
    for rank in range(layout.world):
        shapes = rank_shapes(cfg, layout.at(rank))
        specs = shard_specs(cfg, layout.at(rank), list(shapes))
        problems += _check_rank(rank, shapes, specs, stored, expected)
        for spec in specs.values():
            held[spec.source].append((rank, spec))
    misshapen = {s for s, want in expected.items() if s in stored and stored[s] != want}
    problems += _check_cover(cfg, layout, {s: p for s, p in held.items() if s not in misshapen}, stored)
    unplaced = sorted(n for n in stored if n not in held and ignorable_reason(n) is None)
    if unplaced:
        problems.append(f"{len(unplaced)} checkpoint tensor(s) no rank loads: {unplaced[:6]}")
    return problems
