"""Serving across ranks: rank 0 runs the engine on a MirroredRunner, every other rank replays its calls.

The runner is deterministic: the same admit / release / prefill / decode calls, in the same order, leave
every rank with the same slots, pages and positions. So rank 0 broadcasts each state-changing call (name and
arguments, a few hundred bytes) on a control group before running it, and the followers run the very same
call on their own runner: every forward then launches the same collectives on every rank, and every rank ends
with the same logits (rank 0 samples). The control group is gloo with a long timeout, so an idle server
does not time its followers out.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from k3verify.serving.kv_cache import CacheError
from k3verify.serving.parallel.model import ParallelServingModel
from k3verify.serving.runner import ModelRunner

if TYPE_CHECKING:
    from k3verify.serving.graphs import GraphDecoder
    from k3verify.serving.prefill_graphs import GraphPrefill

log = logging.getLogger(__name__)
MIRRORED = ("admit", "release", "prefill", "decode", "decode_next", "set_next_tokens", "reset_caches")
CONTROL_TIMEOUT = datetime.timedelta(days=365)


class ControlChannel:
    """Call messages from rank 0 to every rank, over a gloo group of its own."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if world > 1 else None

    def send(self, message: tuple[str, tuple[Any, ...]] | None) -> None:
        if self.world > 1:
            dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self) -> tuple[str, tuple[Any, ...]] | None:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        message: tuple[str, tuple[Any, ...]] | None = box[0]
        return message


class MirroredRunner(ModelRunner):
    """Rank 0's runner: each state-changing call is announced to the followers, then run here."""

    def __init__(self, model: ParallelServingModel, channel: ControlChannel, **caches: int) -> None:
        if model.layout.rank != 0:
            raise ValueError(f"the mirrored runner runs on rank 0; this model is rank {model.layout.rank}")
        super().__init__(model, **caches)
        self.channel = channel

    def admit(self, seq_id: int, num_tokens: int, shared: list[int] | None = None, cached: int = 0,
              cuts: tuple[int, ...] = ()) -> None:
        if shared or cached:
            raise ValueError(f"sequence {seq_id}: a parallel runner cannot resume a cached prefix ({cached} tokens): "
                             "the other ranks hold no snapshot of it")
        self.channel.send(("admit", (seq_id, num_tokens)))
        super().admit(seq_id, num_tokens)

    def release(self, seq_id: int) -> None:
        self.channel.send(("release", (seq_id,)))
        super().release(seq_id)

    def prefill(self, seqs: list[tuple[int, list[int]]], graphs: GraphPrefill | None = None) -> torch.Tensor:
        if graphs is not None:
            raise ValueError("CUDA graphs over collectives need the multi-GPU run; a parallel runner prefills eagerly")
        self.channel.send(("prefill", (seqs,)))
        return super().prefill(seqs)

    def decode(self, seqs: list[tuple[int, int]], graphs: GraphDecoder | None = None) -> torch.Tensor:
        if graphs is not None:
            raise ValueError("CUDA graphs over collectives need the multi-GPU run; a parallel runner decodes eagerly")
        self.channel.send(("decode", (seqs,)))
        return super().decode(seqs)

    def decode_next(self, seq_ids: list[int], graphs: GraphDecoder | None = None) -> torch.Tensor:
        if graphs is not None:
            raise ValueError("CUDA graphs over collectives need the multi-GPU run; a parallel runner decodes eagerly")
        self.channel.send(("decode_next", (seq_ids,)))
        return super().decode_next(seq_ids)

    def set_next_tokens(self, seq_ids: list[int], tokens: torch.Tensor | list[int]) -> None:
        """The followers need the ids themselves, so a parallel engine reads each step's ids on the host here
        (no host/GPU overlap across ranks)."""
        ids = tokens if isinstance(tokens, list) else tokens.tolist()
        self.channel.send(("set_next_tokens", (seq_ids, ids)))
        super().set_next_tokens(seq_ids, ids)

    def reset_caches(self) -> None:
        """The engine supervisor's restart: every rank drops its sequences and reallocates its caches."""
        self.channel.send(("reset_caches", ()))
        super().reset_caches()

    def shutdown(self) -> None:
        """Tell the followers to leave their loop."""
        self.channel.send(None)


def follow(runner: ModelRunner, channel: ControlChannel) -> int:
    """A follower's loop: replay rank 0's calls until it says stop; returns how many calls ran. A call the
    runner refuses (its checks run before any collective) was refused on rank 0 too, the same way: it is
    logged and the loop goes on, in step with rank 0."""
    calls = 0
    while (message := channel.receive()) is not None:
        name, args = message
        if name not in MIRRORED:
            raise ValueError(f"rank 0 asked for {name!r}; a follower replays only {MIRRORED}")
        try:
            getattr(ModelRunner, name)(runner, *args)
        except (ValueError, KeyError, CacheError) as exc:
            log.warning("follower: %s%s refused as on rank 0: %s", name, args, exc)
        calls += 1
    return calls
