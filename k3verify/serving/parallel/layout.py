"""Who owns what: the tensor/expert-parallel layout of one rank.

World = max(tp, ep) ranks; each degree is 1 (that part is replicated on every rank) or the whole world
(that part is split over every rank). Every rank sees every token: attention and dense FFN split their
heads / intermediate columns (column-parallel in, row-parallel out, one all-reduce), routed experts are
split by expert id (each rank combines its own experts' terms, the partial sums are all-reduced), the
vocabulary is split for the embedding and lm_head. A count the degree does not divide is split as evenly
as contiguous ranges allow (the first `n % parts` ranks get one more); a count smaller than the degree
is refused, naming it, because a rank with no head would still have to hold weights of width zero.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from k3verify.config import ModelConfig


class LayoutError(ValueError):
    """A parallel layout this model or this world cannot take; the message names the value."""


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """The [start, stop) of part `index` when n items are cut into `parts` contiguous near-equal ranges."""
    if parts < 1 or not 0 <= index < parts:
        raise LayoutError(f"part {index} of {parts} does not exist")
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    ep: int
    rank: int = 0

    def __post_init__(self) -> None:
        for name, value in (("tp", self.tp), ("ep", self.ep)):
            if value < 1:
                raise LayoutError(f"--{name} must be >= 1; got {value}")
        world = self.world
        if self.tp not in (1, world) or self.ep not in (1, world):
            raise LayoutError(f"--tp {self.tp} --ep {self.ep}: each degree must be 1 or the world size {world} "
                              "(attention and experts are split over the same ranks, or not at all)")
        if not 0 <= self.rank < world:
            raise LayoutError(f"rank {self.rank} is outside a world of {world}")

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    def at(self, rank: int) -> ParallelLayout:
        return replace(self, rank=rank)

    def tp_range(self, n: int) -> tuple[int, int]:
        """This rank's share of n tensor-parallel items (heads, columns, vocab rows); all of them when tp = 1."""
        return split_range(n, self.tp, self.rank) if self.tp > 1 else (0, n)

    def ep_range(self, n: int) -> tuple[int, int]:
        """This rank's routed experts [first, stop); all of them when ep = 1."""
        return split_range(n, self.ep, self.rank) if self.ep > 1 else (0, n)

    def describe(self) -> str:
        return f"tp={self.tp} ep={self.ep} (world {self.world})"


def check_layout(cfg: ModelConfig, layout: ParallelLayout) -> None:
    """Refuse a layout that leaves some rank without a KDA head, an MLA head, an expert, a vocab row or a
    column of an FFN it must split."""
    counts: list[tuple[str, int, int]] = [("vocab_size", cfg.vocab_size, layout.tp)]
    if cfg.has_kda:
        counts.append(("linear_attn_config.num_heads (KDA heads)", cfg.kda_num_heads, layout.tp))
    if cfg.has_mla:
        counts.append(("num_attention_heads (MLA heads)", cfg.num_attention_heads, layout.tp))
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        counts.append(("intermediate_size", cfg.intermediate_size, layout.tp))
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        counts.append(("num_experts", cfg.num_experts, layout.ep))
        counts.append(("shared expert intermediate", cfg.shared_intermediate_size, layout.tp))
        if cfg.uses_latent_moe:
            assert cfg.routed_expert_hidden_size is not None
            counts.append(("routed_expert_hidden_size", cfg.routed_expert_hidden_size, layout.tp))
    for name, n, degree in counts:
        if degree > n:
            raise LayoutError(f"{layout.describe()}: {name} = {n} cannot be split over {degree} ranks "
                              f"(rank {n} would own none); use a degree <= {n}")


def local_config(cfg: ModelConfig, layout: ParallelLayout) -> ModelConfig:
    """The config this rank's attention layers and caches are built from: its own KDA and MLA head counts
    (everything else, including the expert count the router scores, stays global)."""
    kda = layout.tp_range(cfg.kda_num_heads)
    mla = layout.tp_range(cfg.num_attention_heads)
    return replace(cfg, kda_num_heads=kda[1] - kda[0], num_attention_heads=mla[1] - mla[0])
