"""CUDA-graph decode: one captured graph per batch-size bucket, replayed over static buffers.

A captured graph bakes tensor addresses AND slice offsets: a cache re-created with the same base
pointer but fewer pages moves every per-layer slice above layer 0. The capture signature therefore
records (data_ptr, shape, stride, dtype) of every cache tensor, and a replay whose signature differs
re-captures (logged) instead of replaying stale slices. Padded rows of a bucket park on the reserved
scratch slot and scratch page (never -1). The Block Attention Residual stack is built inside the
captured step (it is per-pass scratch), so K3 models capture whole.

`static_decode` is the same step without a graph: the CPU tests run it to prove it equals
`ServingModel.decode` bit-exactly and performs no host synchronisation (which capture forbids).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from k3verify.kernels.pinned import host_tensor
from k3verify.serving.batch import SCRATCH, PackedBatch
from k3verify.serving.model import ServingModel
from k3verify.serving.staging import HostStaging

T = TypeVar("T")

log = logging.getLogger("k3verify.graphs")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
Signature = tuple[tuple[str, int, tuple[int, ...], tuple[int, ...], str], ...]


def capture_signature(model: ServingModel) -> Signature:
    """Address, shape and stride of every cache tensor a captured decode step reads or writes."""
    tensors: dict[str, torch.Tensor] = {}
    if model.kv_cache is not None:
        tensors["kv.data"] = model.kv_cache.data
    if model.state_pool is not None:
        tensors.update({f"state.{k}": v for k, v in model.state_pool.tensors().items()})
    return tuple((name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))
                 for name, t in sorted(tensors.items()))


@dataclass
class StaticInputs:
    """Device buffers one bucket's graph reads; rows past the live batch hold scratch values."""

    input_ids: torch.Tensor  # [B] int64
    meta: torch.Tensor  # [2, B] int64: the slots row and the positions row (one copy fills both)
    page_table: torch.Tensor  # [B, P] int64
    cu_seqlens: torch.Tensor  # [B+1] int64 0..B: one token per sequence (constant)
    zeros: torch.Tensor  # [B] int64 zeros: every token's offset in its sequence (constant)

    @classmethod
    def allocate(cls, batch: int, pages_per_seq: int, device: torch.device) -> StaticInputs:
        def z(*shape: int) -> torch.Tensor:
            return torch.full(shape, SCRATCH, dtype=torch.long, device=device)

        cu = torch.arange(batch + 1, dtype=torch.long, device=device)
        return cls(z(batch), z(2, batch), z(batch, pages_per_seq), cu, torch.zeros_like(cu[:batch]))

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def slots(self) -> torch.Tensor:
        return self.meta[0]

    @property
    def positions(self) -> torch.Tensor:  # tokens already cached = position of the new token
        return self.meta[1]

    def fill(self, ids: list[int], slots: list[int], tables: list[list[int]], positions: list[int]) -> None:
        """Copy a live batch into the first rows; the rest park on the scratch slot and page."""
        n, B, P = len(ids), self.size, self.page_table.shape[1]
        if n > B:
            raise ValueError(f"{n} sequences do not fit a bucket of {B}")
        pad = B - n
        table = [list(t) + [SCRATCH] * (P - len(t)) for t in tables] + [[SCRATCH] * P] * pad
        if any(len(t) > P for t in tables):
            raise ValueError(f"a page table longer than the captured width {P}")
        dev = self.input_ids.device
        host = host_tensor([*ids, *[0] * pad, *slots, *[SCRATCH] * pad, *positions, *[0] * pad], dev)
        self.input_ids.copy_(host[:B], non_blocking=True)
        self.meta.view(-1).copy_(host[B:], non_blocking=True)
        self.page_table.copy_(host_tensor(table, dev), non_blocking=True)

    def fill_from_slots(self, slots: list[int], positions: list[int], tokens_by_slot: torch.Tensor,
                        pages_by_slot: torch.Tensor, staging: HostStaging) -> None:
        """The live batch by state slot: one pinned copy of (slots, positions), then each row's input token
        and page table gathered on the device from per-slot tables (no host sync, no per-step page lists).
        Padded rows read slot SCRATCH: its token is never written and its page row is all scratch."""
        n, B, P = len(slots), self.size, self.page_table.shape[1]
        if n > B or len(positions) != n:
            raise ValueError(f"{n} slots / {len(positions)} positions for a bucket of {B}")
        if pages_by_slot.shape[1] < P:
            raise ValueError(f"per-slot page tables are {pages_by_slot.shape[1]} pages wide; this bucket reads {P}")
        pad = B - n
        staging.copy_into(self.meta, [*slots, *[SCRATCH] * pad, *positions, *[0] * pad])
        torch.index_select(tokens_by_slot, 0, self.slots, out=self.input_ids)
        # Wider tables (a runner sized for long prefills) are cut to the captured context: the runner only
        # sends sequences whose whole budget fits it (ModelRunner.decode_next), so the cut drops no page.
        torch.index_select(pages_by_slot[:, :P], 0, self.slots, out=self.page_table)


def static_decode(model: ServingModel, inputs: StaticInputs, max_context: int) -> torch.Tensor:
    """One decode step over static buffers -> [B, V] fp32 logits, with no host synchronisation.

    The host-side lists the layers loop over are fixed by the bucket (B sequences of one token, each
    seen as possibly max_context long); the real positions stay on the device and mask the attention."""
    B = inputs.size
    cu = inputs.cu_seqlens
    batch = PackedBatch(
        input_ids=inputs.input_ids, cu_seqlens=cu, cu_list=list(range(B + 1)), start_pos=inputs.positions,
        start_list=[max_context - 1] * B, slots=inputs.slots, page_table=inputs.page_table,
        seg_ids=cu[:B], local_pos=inputs.zeros, positions=inputs.positions, is_decode=True,
    )
    return model._forward(model._context(batch, None), False, False).logits


def cuda_graph_recorder(step: Callable[[], T], *, flush: bool = True) -> tuple[torch.cuda.CUDAGraph, T]:
    """Two warm-up calls of `step` on a side stream (Triton compilation and autotuning, lazy allocations: outside
    the capture), then one call captured into a CUDA graph (not executed: its replays are). Returns the graph and
    the tensors the captured call wrote, which every replay rewrites in place.

    flush=True captures through torch.cuda.graph, which first waits for the device and empties the caching allocator
    and the pinned host cache (start-up captures). flush=False captures on the warm-up stream itself, with none of
    that: a capture in the middle of serving (a prefill bucket's) would otherwise send every later allocation back
    to cudaMalloc."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    graph = torch.cuda.CUDAGraph()
    if flush:
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            out = step()
        return graph, out
    with torch.cuda.stream(stream):  # ordered after the warm-ups on this stream; a capture executes nothing
        graph.capture_begin()
        try:
            out = step()
        except BaseException:
            try:
                graph.capture_end()  # leave capture mode before the error propagates
            except RuntimeError:
                pass  # the capture was already invalidated by the failing call: the first error is the one to see
            raise
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


class GraphDecoder:
    """Decode through captured CUDA graphs (or, with use_graphs=False, the same static step eagerly)."""

    def __init__(self, model: ServingModel, max_context: int, *, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 use_graphs: bool | None = None) -> None:
        if model.kv_cache is None or model.state_pool is None:
            raise RuntimeError("GraphDecoder needs the model's caches allocated first")
        self.model, self.max_context, self.buckets = model, max_context, tuple(sorted(buckets))
        self.use_graphs = model.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model; this one is on {model.device}")
        self.pages_per_seq = -(-max_context // model.kv_cache.page_size)
        self._inputs: dict[int, StaticInputs] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, Signature]] = {}
        self.staging = HostStaging(model.device)
        self.captures = 0  # how many captures happened (re-captures included): tests assert on it
        self.eager_buckets: dict[int, str] = {}  # bucket -> why its capture failed (decoded eagerly, warned once)
        self.check_signature = True  # the control of the shrink test turns this off to show what it prevents
        # called right before a step's graph replay (or eager decode), its inputs filled: spec/timing.StepTimer
        # starts the cost policy's plain-step time there
        self.before_replay: Callable[[], None] | None = None

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"batch of {n} exceeds the largest captured bucket {self.buckets[-1]}")

    def _static(self, bucket: int) -> StaticInputs:
        if bucket not in self._inputs:
            self._inputs[bucket] = StaticInputs.allocate(bucket, self.pages_per_seq, self.model.device)
        return self._inputs[bucket]

    def capture(self, bucket: int) -> None:
        """Capture (or re-capture) one bucket's graph. Warm-up steps execute: they run on scratch rows only,
        never on a live sequence's state."""
        if not self.use_graphs:
            raise RuntimeError("capture needs use_graphs=True (a CUDA model)")
        inputs = self._static(bucket)
        inputs.fill([], [], [], [])

        def step() -> torch.Tensor:
            with torch.no_grad():
                return static_decode(self.model, inputs, self.max_context)

        try:
            graph, out = cuda_graph_recorder(step)
        except RuntimeError as exc:  # an op that syncs the host or copies from pageable memory: not capturable
            first_line = (str(exc).splitlines() or [""])[0]
            reason = f"{type(exc).__name__}: {first_line}"
            self.eager_buckets[bucket] = reason
            log.warning("CUDA-graph capture of decode bucket %d failed, so that bucket decodes eagerly (the same "
                        "static step, launch by launch): %s", bucket, reason)
            return
        self._graphs[bucket] = (graph, out, capture_signature(self.model))
        self.captures += 1

    def decode(self, ids: list[int], slots: list[int], tables: list[list[int]], positions: list[int]
               ) -> torch.Tensor:
        """[n, V] fp32 logits for n live sequences (rows of the bucket beyond n are scratch); a copy."""
        return self._step(len(ids), lambda inputs: inputs.fill(ids, slots, tables, positions)).clone()

    def decode_slots(self, slots: list[int], positions: list[int], tokens_by_slot: torch.Tensor,
                     pages_by_slot: torch.Tensor) -> torch.Tensor:
        """[n, V] fp32 logits for the sequences on `slots`, whose input tokens and page tables live in the
        per-slot device tables. A view of the bucket's output buffer: valid until the next step of this
        bucket (read or copy it before then; stream order makes that safe without a sync)."""
        return self._step(len(slots), lambda inputs: inputs.fill_from_slots(slots, positions, tokens_by_slot,
                                                                            pages_by_slot, self.staging))

    def ensure_captured(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, Signature] | None:
        """The bucket's graph, captured now if it has none or was captured over other cache tensors; None when
        the bucket decodes eagerly (no graphs, or its capture failed)."""
        if not self.use_graphs or bucket in self.eager_buckets:
            return None
        entry = self._graphs.get(bucket)
        if entry is not None and self.check_signature and entry[2] != capture_signature(self.model):
            log.warning("graph for bucket %d was captured over other cache tensors (address/shape/stride "
                        "changed): re-capturing", bucket)
            entry = None
        if entry is None:
            self.capture(bucket)
            entry = self._graphs.get(bucket)  # None: the capture failed and the bucket went eager
        return entry

    def _step(self, n: int, fill: Callable[[StaticInputs], None]) -> torch.Tensor:
        bucket = self.bucket_for(n)
        inputs = self._static(bucket)
        entry = self.ensure_captured(bucket)
        fill(inputs)
        if self.before_replay is not None:
            self.before_replay()
        if entry is None:
            with torch.no_grad():
                return static_decode(self.model, inputs, self.max_context)[:n]
        graph, out, _ = entry
        graph.replay()
        return out[:n]

    def replay_stale(self, n: int) -> torch.Tensor | None:
        """Replay the bucket's graph over whatever its static inputs hold now, without refilling them (a
        control: what a replay of the previous step's inputs computes). None if no valid graph exists."""
        entry = self._graphs.get(self.bucket_for(n))
        if entry is None or entry[2] != capture_signature(self.model):
            return None
        entry[0].replay()
        return entry[1][:n].clone()


def engine_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below max_batch, then max_batch itself: every decode batch of up to max_batch fits."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1; got {max_batch}")
    return tuple(sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch} | {max_batch}))


def graphs_for(model: ServingModel, max_context: int, max_batch: int) -> GraphDecoder | None:
    """The engine's graph decoder on a CUDA model (buckets up to every state slot decoding at once); None on
    other devices, where the engine decodes eagerly."""
    if model.device.type != "cuda":
        return None
    return GraphDecoder(model, max_context, buckets=engine_buckets(max_batch))
