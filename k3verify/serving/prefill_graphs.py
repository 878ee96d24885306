"""CUDA-graph prefill: a pack of fresh sequences replayed from a graph captured per bucket of its shape.

Why: an eager prefill is host-bound on a fast GPU: its hundreds of kernel launches, a hundred or so of them Triton
launches through Python, take the host longer than their kernels take the device, and every served TTFT pays that.
A replay pays one launch.

A bucket (`PrefillShape`) fixes what a graph bakes in: T tokens, B sequences, no sequence longer than L. A pack of
n fresh sequences fits a bucket by padding: its tokens first, then filler sequences of at most L tokens that make
the total T, then empty sequences that make the count B. Fillers and empty sequences park on the scratch state slot
and the scratch page (batch.SCRATCH), as a decode graph's padded rows do; their logits are never read. The offsets
reach the layers as a `DeviceSeqlens` (kernels/varlen.py): on the device only, so the graph rebuilds everything
that depends on the lengths at every replay (fla's chunk list, the attention's gathers, the conv's segments), and a
layer that reads them on the host raises (batch.DeviceOnly) instead of baking the capture's lengths in.

Only fresh sequences (nothing cached, no segmenting) take a graph; a continuation (a chunked prompt's later piece)
runs eagerly. Capture happens on a shape's `capture_after`-th sighting (one-off shapes do not pay a capture), over
scratch rows only; at most `max_graphs` are kept, a new shape displacing the least sighted one only when seen more
often than it; a capture that fails leaves that bucket eager with one logged warning. Until a pack's own bucket has
a graph, the smallest kept graph of at most MAX_BORROW x its tokens that it fits replays it (more padding on the
device is cheaper than a host-bound eager prefill). The capture signature of
the decode graphs (serving/graphs.capture_signature) guards against caches re-created under a graph.

`static_prefill` is the same step without a graph: the CPU tests run it against ServingModel.prefill.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3verify.kernels.varlen import DeviceSeqlens
from k3verify.serving.batch import SCRATCH, DeviceOnly, PackedBatch, segment_ids
from k3verify.serving.graphs import Signature, capture_signature, cuda_graph_recorder
from k3verify.serving.model import ServingModel
from k3verify.serving.staging import HostStaging

log = logging.getLogger("k3verify.prefill_graphs")

MIN_LEN = 64  # the smallest length bound (one KDA chunk)
MAX_PADDED_RATIO = 4  # B x L (the padded attention's rows) may be at most this many times T
MAX_BORROW = 2  # a pack may replay a kept graph of at most this many times its own bucket's tokens


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _eighths(n: int, least: int) -> int:
    """n rounded up to a multiple of an eighth of its power of two, or of `least` when that is more (then at least
    `least`): four sizes per octave, so padding adds at most a quarter."""
    step = max(least, _pow2(n) // 8)
    return -(-n // step) * step


@dataclass(frozen=True)
class PrefillShape:
    num_tokens: int  # T
    num_seqs: int  # B: live + filler + empty sequences
    max_len: int  # L: no sequence is longer

    @property
    def padded_rows(self) -> int:
        return self.num_seqs * self.max_len


def prefill_shape(seq_lens: Sequence[int], *, max_tokens: int, max_seqs: int) -> PrefillShape | None:
    """The bucket a pack of fresh sequences of these lengths pads to, or None when none is worth it: L the longest
    and T the total, each rounded up to an eighth of its power of two (L to at least MIN_LEN, T to a multiple of L
    when that is coarser: a prompt of 4,100 tokens pads to 5,120 where the next power of two would double it);
    B the next power of two of the live sequences plus the fillers that make up T. None past max_tokens /
    max_seqs, or when the padded attention would hold more than MAX_PADDED_RATIO x T rows (one long prompt among
    short ones)."""
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError(f"a prefill needs sequences of at least one token; got lengths {list(seq_lens)}")
    total = sum(seq_lens)
    L = _eighths(max(seq_lens), MIN_LEN)
    T = _eighths(total, L)
    B = _pow2(len(seq_lens) + _fillers(T - total, L))
    if T > max_tokens or B > max_seqs or B * L > MAX_PADDED_RATIO * T:
        return None
    return PrefillShape(T, B, L)


def _fillers(pad: int, max_len: int) -> int:
    """How many filler sequences of at most max_len tokens make up `pad` tokens."""
    return -(-pad // max_len)


def fits(shape: PrefillShape, seq_lens: Sequence[int]) -> bool:
    """Whether a pack of fresh sequences of these lengths (none: the capture's all-filler pack) fits a bucket: the
    lengths, and the fillers that make up its tokens, within its bounds."""
    total = sum(seq_lens)
    if total > shape.num_tokens or max(seq_lens, default=0) > shape.max_len:
        return False
    return len(seq_lens) + _fillers(shape.num_tokens - total, shape.max_len) <= shape.num_seqs


def filler_lens(shape: PrefillShape, seq_lens: Sequence[int]) -> list[int]:
    """Lengths of the filler sequences that pad `seq_lens` to shape.num_tokens, each at most shape.max_len."""
    pad = shape.num_tokens - sum(seq_lens)
    return [min(shape.max_len, pad - i) for i in range(0, pad, shape.max_len)]


class PrefillInputs:
    """Device buffers one bucket's graph reads, all views of one int64 tensor (one staged copy fills them):
    token ids [T], offsets [B+1], state slots [B], page table [B, P]."""

    def __init__(self, shape: PrefillShape, page_size: int, device: torch.device) -> None:
        T, B = shape.num_tokens, shape.num_seqs
        pages = -(-shape.max_len // page_size)
        self.shape, self.pages, self.page_size = shape, pages, page_size
        self.buffer = torch.zeros(T + (B + 1) + B + B * pages, dtype=torch.long, device=device)
        ids, cu, slots, table = self.buffer.split([T, B + 1, B, B * pages])
        self.input_ids, self.cu_seqlens, self.slots, self.page_table = ids, cu, slots, table.view(B, pages)
        self.start_pos = torch.zeros(B, dtype=torch.long, device=device)  # fresh sequences only (constant)

    def values(self, ids: Sequence[int], seq_lens: Sequence[int], slots: Sequence[int],
               tables: Sequence[Sequence[int]]) -> list[int]:
        """The buffer's contents for live sequences (ids packed in order): fillers and empty sequences after them
        on the scratch slot and page. Checks what a graph cannot: the pack fits the bucket."""
        s, P = self.shape, self.pages
        n = len(seq_lens)
        if sum(seq_lens) != len(ids) or len(slots) != n or len(tables) != n:
            raise ValueError(f"{len(ids)} ids, {n} lengths (sum {sum(seq_lens)}), {len(slots)} slots and "
                             f"{len(tables)} page tables do not describe one pack")
        if min(seq_lens, default=1) < 1 or not fits(s, seq_lens):
            raise ValueError(f"lengths {list(seq_lens)} (and their fillers) do not fit the bucket {s}")
        if any(int(x) == SCRATCH for x in slots):
            raise ValueError(f"a live sequence on the scratch slot: {list(slots)}")
        fill = filler_lens(s, seq_lens)
        count = n + len(fill)
        cu = [0]
        for m in [*seq_lens, *fill]:
            cu.append(cu[-1] + m)
        cu += [cu[-1]] * (s.num_seqs - count)
        rows = []
        for m, t in zip(seq_lens, tables, strict=True):
            row = [int(p) for p in t[:P]]  # a fresh sequence of at most L tokens reads only its first P pages
            if len(row) < -(-m // self.page_size) or SCRATCH in row:
                raise ValueError(f"page table {list(t)} cannot hold {m} tokens at page size {self.page_size} "
                                 "without the scratch page")
            rows.append(row + [SCRATCH] * (P - len(row)))
        rows += [[SCRATCH] * P] * (s.num_seqs - n)
        return [*map(int, ids), *[0] * (s.num_tokens - len(ids)), *cu, *map(int, slots),
                *[SCRATCH] * (s.num_seqs - n), *[p for r in rows for p in r]]

    def fill(self, staging: HostStaging, ids: Sequence[int], seq_lens: Sequence[int], slots: Sequence[int],
             tables: Sequence[Sequence[int]]) -> None:
        staging.copy_into(self.buffer, self.values(ids, seq_lens, slots, tables))


def static_batch(inputs: PrefillInputs) -> PackedBatch:
    """The pack a bucket's buffers describe, its per-token metadata computed on the device from the offsets."""
    s = inputs.shape
    cu = inputs.cu_seqlens
    seg = segment_ids(cu, s.num_tokens)  # never an empty trailing sequence: they start at T
    local = torch.arange(s.num_tokens, device=cu.device) - cu[seg]
    return PackedBatch(
        input_ids=inputs.input_ids, cu_seqlens=cu, cu_list=DeviceOnly("sequence offsets"), start_pos=inputs.start_pos,
        start_list=DeviceOnly("cached-prefix lengths"), slots=inputs.slots, page_table=inputs.page_table,
        seg_ids=seg, local_pos=local, positions=local, static=DeviceSeqlens(cu, s.num_tokens, s.max_len),
    )


def static_prefill(model: ServingModel, inputs: PrefillInputs) -> torch.Tensor:
    """One prefill over a bucket's buffers -> [B, V] fp32 logits of every sequence's last token (fillers' and empty
    sequences' rows included), with no host synchronisation and no host value but the bucket's bounds."""
    return model._forward(model._context(static_batch(inputs), None), False, False).logits


class GraphPrefill:
    """Prefill of fresh sequences through captured CUDA graphs per bucket (or, with use_graphs=False, the same static
    step eagerly: the CPU tests). `prefill` returns None for a pack no bucket takes: the caller runs it eagerly."""

    def __init__(self, model: ServingModel, *, max_tokens: int, max_seqs: int, use_graphs: bool | None = None,
                 capture_after: int = 2, max_graphs: int = 8) -> None:
        if model.kv_cache is None or model.state_pool is None:
            raise RuntimeError("GraphPrefill needs the model's caches allocated first")
        if capture_after < 1 or max_graphs < 1:
            raise ValueError(f"capture_after and max_graphs must be >= 1; got {capture_after}, {max_graphs}")
        self.model, self.max_tokens, self.max_seqs = model, max_tokens, max_seqs
        self.use_graphs = model.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model; this one is on {model.device}")
        self.capture_after, self.max_graphs = capture_after, max_graphs
        self.staging = HostStaging(model.device)
        self._inputs: dict[PrefillShape, PrefillInputs] = {}
        self._graphs: dict[PrefillShape, tuple[torch.cuda.CUDAGraph, torch.Tensor, Signature]] = {}
        self.sightings: Counter[PrefillShape] = Counter()
        self.eager_shapes: dict[PrefillShape, str] = {}  # bucket -> why its capture failed (warned once)
        self.captures = 0  # captures done (re-captures included)
        self.evictions = 0  # graphs dropped for a more frequent shape
        self.replays = 0  # prefills served by a graph replay
        self.borrowed = 0  # of those, replays of a larger bucket's graph (the pack's own not captured yet)
        self.static_runs = 0  # prefills served by the static step without a graph

    def shape_for(self, seq_lens: Sequence[int]) -> PrefillShape | None:
        return prefill_shape(seq_lens, max_tokens=self.max_tokens, max_seqs=self.max_seqs)

    def _static(self, shape: PrefillShape) -> PrefillInputs:
        if shape not in self._inputs:
            assert self.model.kv_cache is not None
            self._inputs[shape] = PrefillInputs(shape, self.model.kv_cache.page_size, self.model.device)
        return self._inputs[shape]

    def capture(self, shape: PrefillShape) -> None:
        """Capture (or re-capture) one bucket; its warm-up calls run on scratch rows only."""
        if not self.use_graphs:
            raise RuntimeError("capture needs use_graphs=True (a CUDA model)")
        inputs = self._static(shape)
        inputs.fill(self.staging, [], [], [], [])

        def step() -> torch.Tensor:
            with torch.no_grad():
                return static_prefill(self.model, inputs)

        try:
            graph, out = cuda_graph_recorder(step, flush=False)  # mid-serving: no device sync, no cache flush
        except Exception as exc:  # a host sync, a pageable copy, a host read of the offsets, a kernel's own assert
            reason = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            self.eager_shapes[shape] = reason
            log.warning("CUDA-graph capture of prefill bucket %s failed, so packs of that bucket prefill eagerly: %s",
                        shape, reason)
            return
        self._graphs[shape] = (graph, out, capture_signature(self.model))
        self.captures += 1

    def _graph(self, shape: PrefillShape) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, Signature] | None:
        entry = self._graphs.get(shape)
        if entry is not None and entry[2] != capture_signature(self.model):
            log.warning("prefill graph %s was captured over other cache tensors: re-capturing", shape)
            del self._graphs[shape]
            entry = None
        if entry is None and self.sightings[shape] >= self.capture_after and self._make_room(shape):
            self.capture(shape)
            entry = self._graphs.get(shape)
        return entry

    def _make_room(self, shape: PrefillShape) -> bool:
        """Room for `shape`'s graph among at most max_graphs: free, or made by evicting the least sighted graph when
        `shape` has been seen more often than it (so a shape seen now and then never displaces a frequent one, and
        two shapes cannot evict each other back and forth: a capture costs three prefills' host time in a step)."""
        if len(self._graphs) < self.max_graphs:
            return True
        victim = min(self._graphs, key=lambda s: self.sightings[s])
        if self.sightings[shape] <= self.sightings[victim]:
            return False
        del self._graphs[victim]
        self.evictions += 1
        log.info("prefill graph %s evicted for %s (at most %d kept; sightings %d < %d)", victim, shape,
                 self.max_graphs, self.sightings[victim], self.sightings[shape])
        return True

    def prefill(self, ids: Sequence[int], seq_lens: Sequence[int], slots: Sequence[int],
                tables: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """[n, V] fp32 logits of each live sequence's last token (a copy), or None when no bucket takes the pack, or
        the graphs are on and this bucket has none yet (its first sightings, or a failed capture): the caller runs
        those eagerly."""
        shape = self.shape_for(seq_lens)
        if shape is None or shape in self.eager_shapes:
            return None
        self.sightings[shape] += 1
        entry = self._graph(shape) if self.use_graphs else None
        if self.use_graphs and entry is None:  # not yet captured: a kept graph of a larger bucket may take it
            larger = self._larger_fit(shape, seq_lens)
            if larger is None:
                return None
            shape, entry = larger, self._graphs[larger]
            self.borrowed += 1
        inputs = self._static(shape)
        inputs.fill(self.staging, ids, seq_lens, slots, tables)
        n = len(seq_lens)
        if entry is None:
            self.static_runs += 1
            with torch.no_grad():
                return static_prefill(self.model, inputs)[:n].clone()
        graph, out, _ = entry
        graph.replay()
        self.replays += 1
        return out[:n].clone()

    def _larger_fit(self, shape: PrefillShape, seq_lens: Sequence[int]) -> PrefillShape | None:
        """The kept graph with the fewest tokens, at most MAX_BORROW x its own bucket's, that `seq_lens` fits (valid
        over the current caches): replaying more padding is cheaper than a host-bound eager prefill, and a pack
        seen once does not wait for its own capture."""
        sig = None
        best = None
        for kept in self._graphs:
            if kept.num_tokens > MAX_BORROW * shape.num_tokens or not fits(kept, seq_lens):
                continue
            if best is not None and kept.num_tokens >= best.num_tokens:
                continue
            sig = sig or capture_signature(self.model)
            if self._graphs[kept][2] == sig:
                best = kept
        return best

    def replay_stale(self, seq_lens: Sequence[int]) -> torch.Tensor | None:
        """Replay the graph of the bucket `seq_lens` fits over whatever its buffers hold now, without refilling them
        (a control: what a replay of the previous pack computes). None if that bucket has no valid graph."""
        shape = self.shape_for(seq_lens)
        entry = None if shape is None else self._graphs.get(shape)
        if entry is None or entry[2] != capture_signature(self.model):
            return None
        entry[0].replay()
        return entry[1][:len(seq_lens)].clone()


def prefill_graphs_for(model: ServingModel, max_step_tokens: int, num_slots: int) -> GraphPrefill | None:
    """The engine's prefill graphs on a CUDA model: buckets up to the step's token budget and twice the state slots
    (fillers count as sequences); None on other devices."""
    if model.device.type != "cuda":
        return None
    return GraphPrefill(model, max_tokens=_pow2(max_step_tokens), max_seqs=2 * _pow2(num_slots))
