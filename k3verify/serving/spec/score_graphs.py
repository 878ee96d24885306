"""CUDA graphs of the score pass: one captured graph per row-count bucket, replayed over static buffers.

The captured step saves the latents its rows are about to overwrite, then runs the score forward (KDA
records into the arena, MLA latents into the cache): the same sequence SpecScorer runs eagerly. Padded
rows of a bucket park on the scratch slot and the scratch page. A replay whose cache or arena tensors
moved (capture signature) re-captures, logged. `static_score` is the same step without a graph.

How a step is recorded is a seam (`Recorder`): on CUDA, `cuda_graph_recorder` (warm-up, then a CUDA-graph
capture); a recorder that replays by running the step again over the same static buffers
(gates/shared/replay.py) puts the static-buffer bookkeeping under test on any device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from k3verify.serving.batch import SCRATCH, PackedBatch
from k3verify.serving.graphs import Signature, capture_signature, cuda_graph_recorder
from k3verify.serving.model import ServingModel
from k3verify.serving.spec.arena import ScoreArena, ScorePass
from k3verify.serving.staging import HostStaging

log = logging.getLogger("k3verify.graphs")


@dataclass
class ScoreInputs:
    """Device buffers of one bucket (B rows x n positions); rows past the live ones hold scratch values. The
    per-pass inputs are views of one int64 buffer (`live`), so a fill is one staged host-to-device copy."""

    live: torch.Tensor  # [B * n + 2 * B + B * n + B * P]: input_ids, slots, starts, positions, page_table
    seg_ids: torch.Tensor  # [B * n] constant
    local_pos: torch.Tensor  # [B * n] constant
    cu_seqlens: torch.Tensor  # [B + 1] constant
    rows: int
    n: int

    @classmethod
    def allocate(cls, rows: int, n: int, pages_per_seq: int, device: torch.device) -> ScoreInputs:
        seg = torch.arange(rows, device=device).repeat_interleave(n)
        local = torch.arange(n, device=device).repeat(rows)
        cu = torch.arange(0, rows * n + 1, n, device=device)
        live = torch.full((2 * rows * n + 2 * rows + rows * pages_per_seq,), SCRATCH, dtype=torch.long, device=device)
        inputs = cls(live, seg, local, cu, rows, n)
        inputs.positions.copy_(local)
        return inputs

    def _part(self, start: int, size: int) -> torch.Tensor:
        return self.live[start:start + size]

    @property
    def input_ids(self) -> torch.Tensor:  # [B * n]
        return self._part(0, self.rows * self.n)

    @property
    def slots(self) -> torch.Tensor:  # [B]
        return self._part(self.rows * self.n, self.rows)

    @property
    def starts(self) -> torch.Tensor:  # [B] tokens cached before the score
        return self._part(self.rows * (self.n + 1), self.rows)

    @property
    def positions(self) -> torch.Tensor:  # [B * n]
        return self._part(self.rows * (self.n + 2), self.rows * self.n)

    @property
    def page_table(self) -> torch.Tensor:  # [B, P]
        B, n = self.rows, self.n
        return self.live[2 * B * (n + 1):].view(B, -1)

    def fill(self, ids: list[int], slots: list[int], tables: list[list[int]], starts: list[int], n: int,
             staging: HostStaging) -> None:
        """The live rows first, padded rows on the scratch slot and page: one copy of the whole `live` buffer
        through `staging`'s pinned ring (the host never waits for the GPU)."""
        B, P, live = self.rows, self.page_table.shape[1], len(slots)
        if n != self.n or live > B or any(len(t) > P for t in tables) or len(ids) != live * n:
            raise ValueError(f"{live} rows / {len(ids)} tokens / tables {[len(t) for t in tables]} do not fit a "
                             f"bucket of {B} rows x {self.n} tokens, {P} pages")
        pad = B - live
        starts_all = [*starts, *[0] * pad]
        values = [*ids, *[0] * (pad * n), *slots, *[SCRATCH] * pad, *starts_all,
                  *[s + j for s in starts_all for j in range(n)]]
        for t in tables:
            values += t
            values += [SCRATCH] * (P - len(t))
        values += [SCRATCH] * (pad * P)
        staging.copy_into(self.live, values)


def static_score(model: ServingModel, score: ScorePass, inputs: ScoreInputs,
                  max_context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Save the latents the rows will overwrite, run the score forward -> ([B * n, V] logits, latent rows [B * n]).
    No host synchronisation: host-side lists are fixed by the bucket (every row seen as up to max_context long)."""
    assert model.kv_cache is not None
    B, n = inputs.rows, score.num_positions
    batch = PackedBatch(
        input_ids=inputs.input_ids, cu_seqlens=inputs.cu_seqlens, cu_list=list(range(0, B * n + 1, n)),
        start_pos=inputs.starts, start_list=[max_context - n] * B, slots=inputs.slots, page_table=inputs.page_table,
        seg_ids=inputs.seg_ids, local_pos=inputs.local_pos, positions=inputs.positions,
    )
    rows = model.kv_cache.rows(inputs.page_table, inputs.seg_ids, inputs.positions)
    score.arena.save_latents(model.kv_cache, rows)
    return model.score(batch, score), rows


StepOutputs = tuple[torch.Tensor, torch.Tensor]  # (logits [B * n, V], latent rows [B * n]) of static_score


class Replayable(Protocol):
    def replay(self) -> None: ...


# A recorder turns the score step into something replayable plus the tensors its replays write.
Recorder = Callable[[Callable[[], StepOutputs]], tuple[Replayable, StepOutputs]]


class ScoreGraphs:
    def __init__(self, model: ServingModel, arena: ScoreArena, max_context: int, *, buckets: tuple[int, ...],
                 fused: bool = False, use_graphs: bool | None = None, recorder: Recorder | None = None) -> None:
        """use_graphs: record per bucket (default: on a CUDA model) or run the static step eagerly. recorder: how
        a step is recorded (default cuda_graph_recorder, which needs a CUDA model)."""
        if model.kv_cache is None or model.state_pool is None:
            raise RuntimeError("ScoreGraphs needs the model's caches allocated first")
        if max(buckets) > arena.max_rows:
            raise ValueError(f"bucket {max(buckets)} exceeds the arena's {arena.max_rows} rows")
        self.model, self.max_context, self.buckets = model, max_context, tuple(sorted(buckets))
        self.score_pass = ScorePass(arena, arena.num_positions, fused)
        if recorder is not None and use_graphs is False:
            raise ValueError("a recorder was given with use_graphs=False: nothing would be recorded")
        default = model.device.type == "cuda" or recorder is not None
        self.use_graphs = default if use_graphs is None else use_graphs
        if self.use_graphs and recorder is None and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model; this one is on {model.device}")
        self.recorder: Recorder = cuda_graph_recorder if recorder is None else recorder
        self.pages_per_seq = -(-max_context // model.kv_cache.page_size)
        self._inputs: dict[int, ScoreInputs] = {}
        self.staging = HostStaging(model.device)  # the fills' pinned ring
        self._graphs: dict[int, tuple[Replayable, torch.Tensor, torch.Tensor, Signature]] = {}
        self.captures = 0

    def bucket_for(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(f"{rows} score rows exceed the largest captured bucket {self.buckets[-1]}")

    def _static(self, bucket: int) -> ScoreInputs:
        if bucket not in self._inputs:
            self._inputs[bucket] = ScoreInputs.allocate(bucket, self.score_pass.num_positions, self.pages_per_seq,
                                                         self.model.device)
        return self._inputs[bucket]

    def _signature(self) -> Signature:
        arena = self.score_pass.arena
        extra = tuple((name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))
                      for name, t in (("arena.state", arena.state), ("arena.conv", arena.conv),
                                      ("arena.latents", arena.latents)))
        return capture_signature(self.model) + extra

    def _capture(self, bucket: int) -> None:
        inputs = self._static(bucket)
        # warm-up and capture touch scratch rows only
        inputs.fill([], [], [], [], self.score_pass.num_positions, self.staging)

        def step() -> StepOutputs:
            with torch.no_grad():
                return static_score(self.model, self.score_pass, inputs, self.max_context)

        graph, (logits, rows) = self.recorder(step)
        self._graphs[bucket] = (graph, logits, rows, self._signature())
        self.captures += 1

    def _entry(self, bucket: int) -> tuple[Replayable, torch.Tensor, torch.Tensor, Signature]:
        """The bucket's recorded step, (re-)captured first when missing or recorded over other tensors."""
        entry = self._graphs.get(bucket)
        if entry is not None and entry[3] != self._signature():
            log.warning("score graph for bucket %d was captured over other cache / arena tensors: re-capturing",
                        bucket)
            entry = None
        if entry is None:
            self._capture(bucket)
            entry = self._graphs[bucket]
        return entry

    def score(self, ids: list[int], slots: list[int], tables: list[list[int]], starts: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [B * n, V], slots [B], latent rows [B * n]) for B live rows (views of the bucket's buffers:
        use them before the next score)."""
        n, B = self.score_pass.num_positions, len(slots)
        bucket = self.bucket_for(B)
        inputs = self._static(bucket)
        if not self.use_graphs:
            inputs.fill(ids, slots, tables, starts, n, self.staging)
            with torch.no_grad():
                logits, rows = static_score(self.model, self.score_pass, inputs, self.max_context)
            return logits[: B * n], inputs.slots[:B], rows[: B * n]
        graph, logits, rows, _ = self._entry(bucket)
        inputs.fill(ids, slots, tables, starts, n, self.staging)
        graph.replay()
        return logits[: B * n], inputs.slots[:B], rows[: B * n]

    def replay_stale(self, rows: int) -> torch.Tensor:
        """A control's fault: replay the bucket of `rows` over whatever its static inputs hold now (the previous
        score's pack, or the capture's scratch rows), without a refill -> logits [rows * n, V] (a view)."""
        if not self.use_graphs:
            raise RuntimeError("replay_stale needs recorded steps (use_graphs)")
        graph, logits, _, _ = self._entry(self.bucket_for(rows))
        graph.replay()
        return logits[: rows * self.score_pass.num_positions]
