"""Snapshots of a sequence's KDA state at one prompt position: every KDA layer's fp32 recurrent state and its q/k/v
short-conv windows, copied out of the state pool, and copied back into another sequence's slot to resume there.

A linear-attention layer keeps no per-token cache, so a prefix hit can only resume where a snapshot was taken.
A snapshot is never handed to a running sequence: `restore` copies it into the sequence's own slot, so nothing a
sequence computes can change it. An exact-end snapshot (a whole-prompt entry) also keeps the logits of the
prompt's last position, which a resumed request samples its first token from without prefilling anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3verify.serving.state_cache import KDAStatePool

POOL_TENSORS = ("state", "conv_q", "conv_k", "conv_v")


@dataclass(eq=False)
class Snapshot:
    """The KDA state of one sequence after `position` prompt tokens.

    state [kda_layers, heads, dk, dv] fp32; conv_q/k/v [kda_layers, kda_dim, W-1] fp32; logits [V] fp32 or None.
    """

    position: int
    tensors: dict[str, torch.Tensor]
    logits: torch.Tensor | None = None
    cuts: tuple[int, ...] = ()  # where the prefill that made this state was cut (positions below `position`)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.logits is None else self.logits.numel() * self.logits.element_size()
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) + extra


def snapshot_bytes(pool: KDAStatePool, vocab_size: int = 0) -> int:
    """What one snapshot of `pool`'s shapes costs (with a logits row of `vocab_size` fp32 values)."""
    return sum(t[:, 0].numel() * t.element_size() for t in pool.tensors().values()) + 4 * vocab_size


def take(pool: KDAStatePool, slot: int, position: int, logits: torch.Tensor | None = None,
         cuts: tuple[int, ...] = ()) -> Snapshot:
    """Copy slot `slot`'s state and windows (as they stand after `position` tokens, made by a prefill cut at
    `cuts`) out of the pool."""
    if slot not in pool.used_slots:
        raise ValueError(f"KDA state slot {slot} is not in use: there is no sequence state to snapshot")
    tensors = {name: t[:, slot].clone() for name, t in pool.tensors().items()}
    row = None if logits is None else logits.detach().float().reshape(-1).clone()
    return Snapshot(position, tensors, row, tuple(c for c in cuts if 0 < c < position))


def restore(snap: Snapshot, pool: KDAStatePool, slot: int) -> None:
    """Copy the snapshot into slot `slot` (a sequence resuming at snap.position)."""
    if slot not in pool.used_slots:
        raise ValueError(f"KDA state slot {slot} is not in use: allocate it before restoring into it")
    for name, t in pool.tensors().items():
        src = snap.tensors[name]
        if src.shape != t[:, slot].shape:
            raise ValueError(f"snapshot {name} has shape {tuple(src.shape)}; the pool's slot holds "
                             f"{tuple(t[:, slot].shape)}")
        t[:, slot].copy_(src)
