"""Packed batches: B sequences flattened to one token stream of T tokens plus the metadata every
layer needs to keep the sequences apart (segment ids, positions, state slots, page tables).

Shape legend: T tokens in the pack, B sequences, P pages per page-table row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch

from k3verify.kernels.varlen import DeviceSeqlens

SCRATCH = 0  # reserved page / state slot: padding rows park here, never at -1


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of every token. right=True: a token at position cu[i] belongs to sequence i
    (right=False would hand every first token to the previous sequence)."""
    positions = torch.arange(total, device=cu_seqlens.device)
    return torch.bucketize(positions, cu_seqlens, right=True) - 1


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [B+1] int64, offsets of each sequence's new tokens in the pack
    cu_list: list[int]  # the same on the host (loops over sequences never sync)
    start_pos: torch.Tensor  # [B] tokens each sequence already has cached (0 = fresh sequence)
    start_list: list[int]
    slots: torch.Tensor | None  # [B] KDA state slots
    page_table: torch.Tensor | None  # [B, P] latent-cache pages, padded with SCRATCH
    seg_ids: torch.Tensor  # [T] sequence of each token
    local_pos: torch.Tensor  # [T] offset from the sequence's first token in this pack
    positions: torch.Tensor  # [T] absolute position in its sequence (start_pos + local_pos)
    is_decode: bool = False  # one token per sequence, run with the recurrent/absorbed decode kernels
    # A static pack (serving/prefill_graphs.py: replayed from a CUDA graph): fresh sequences whose offsets live on
    # the device only. Its cu_list / start_list raise when read: a host value would be baked into the graph.
    static: DeviceSeqlens | None = None

    @property
    def num_seqs(self) -> int:
        return self.static.num_seqs if self.static is not None else len(self.cu_list) - 1

    @property
    def num_tokens(self) -> int:
        return self.static.num_tokens if self.static is not None else self.cu_list[-1]

    @property
    def seq_lens(self) -> list[int]:
        return [b - a for a, b in zip(self.cu_list[:-1], self.cu_list[1:], strict=True)]

    @property
    def has_prefix(self) -> bool:
        return self.static is None and any(s > 0 for s in self.start_list)

    @property
    def last_token_index(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - 1

    @classmethod
    def build(cls, input_ids: torch.Tensor, seq_lens: Sequence[int], *, start_pos: Sequence[int] | None = None,
              slots: Sequence[int] | None = None, page_tables: Sequence[Sequence[int]] | None = None,
              page_size: int | None = None, is_decode: bool = False,
              device: torch.device | str | None = None,
              stage: Callable[[list[int]], torch.Tensor] | None = None) -> PackedBatch:
        """Validate and lay out one pack. `page_tables[i]` lists sequence i's pages in order; it must
        cover start_pos[i] + seq_lens[i] tokens. `stage` (serving/staging.HostStaging.to_device) moves the
        host-side ints (token ids, offsets, starts, slots, page table) to `device` in one copy that does not
        wait for the GPU; without it each is its own copy from pageable memory, which on CUDA waits for every
        kernel already queued (in the engine: the decode step in flight)."""
        device = torch.device(device) if device is not None else input_ids.device
        lens = [int(n) for n in seq_lens]
        if not lens or any(n <= 0 for n in lens):
            raise ValueError(f"every sequence in a pack needs at least one token; got lengths {lens}")
        if input_ids.dim() != 1 or input_ids.numel() != sum(lens):
            raise ValueError(f"input_ids must be 1-D with sum(seq_lens)={sum(lens)} tokens; "
                             f"got {tuple(input_ids.shape)}")
        starts = [int(s) for s in start_pos] if start_pos is not None else [0] * len(lens)
        if len(starts) != len(lens) or any(s < 0 for s in starts):
            raise ValueError(f"start_pos must give one non-negative offset per sequence; got {starts}")
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        slot_list = None
        if slots is not None:
            if len(slots) != len(lens) or any(int(s) == SCRATCH for s in slots):
                raise ValueError(f"slots must give one non-scratch state slot per sequence; got {list(slots)}")
            slot_list = [int(s) for s in slots]
        padded = None
        if page_tables is not None:
            if page_size is None or len(page_tables) != len(lens):
                raise ValueError("page_tables need page_size and one row per sequence")
            for i, row in enumerate(page_tables):
                need = -(-(starts[i] + lens[i]) // page_size)
                if len(row) < need or any(int(p) == SCRATCH for p in row):
                    raise ValueError(f"sequence {i}: {len(row)} page(s) {list(row)} cannot hold "
                                     f"{starts[i] + lens[i]} tokens at page size {page_size} (needs {need}, "
                                     f"none of them the scratch page)")
            width = max(len(r) for r in page_tables)
            padded = [list(map(int, r)) + [SCRATCH] * (width - len(r)) for r in page_tables]
        if stage is not None:
            ids_t, cu_t, start_t, slot_t, table_t = _staged(stage, input_ids, cu, starts, slot_list, padded)
        else:
            ids_t = input_ids.to(device)
            cu_t = torch.tensor(cu, dtype=torch.long, device=device)
            start_t = torch.tensor(starts, dtype=torch.long, device=device)
            slot_t = None if slot_list is None else torch.tensor(slot_list, dtype=torch.long, device=device)
            table_t = None if padded is None else torch.tensor(padded, dtype=torch.long, device=device)
        seg = segment_ids(cu_t, cu[-1])
        local = torch.arange(cu[-1], device=cu_t.device) - cu_t[seg]
        return cls(ids_t, cu_t, cu, start_t, starts, slot_t, table_t, seg, local, start_t[seg] + local, is_decode)


class DeviceOnly(list[int]):
    """The host-side offsets of a static pack: any read raises (the values live on the device; a kernel that read
    them here would bake the capture's lengths into a CUDA graph and replay them stale)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def _refuse(self, *_: object) -> NoReturn:
        raise RuntimeError(f"{self.what} of a static (CUDA-graph) pack live on the device only; this code path read "
                           "them on the host, which a captured graph would replay stale")

    __getitem__ = __iter__ = __len__ = __contains__ = __reversed__ = _refuse


def _staged(stage: Callable[[list[int]], torch.Tensor], input_ids: torch.Tensor, cu: list[int], starts: list[int],
            slots: list[int] | None, table: list[list[int]] | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The pack's host ints as views of one staged int64 tensor: ids, cu_seqlens, starts, slots, page table."""
    if input_ids.dtype != torch.long:
        raise ValueError(f"staged token ids must be int64; got {input_ids.dtype}")
    parts: list[list[int]] = [input_ids.tolist(), cu, starts, slots or [], [p for row in table or [] for p in row]]
    ids_t, cu_t, start_t, slot_v, table_v = stage([v for part in parts for v in part]).split([len(p) for p in parts])
    return (ids_t, cu_t, start_t, None if slots is None else slot_v,
            None if table is None else table_v.view(len(table), -1))
