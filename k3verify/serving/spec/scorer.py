"""SpecScorer: score passes and commits over a ModelRunner's model and caches.

score([(seq_id, [last accepted token, d_1 .. d_k]), ...]) runs one packed pass over k+1 tokens per
sequence at positions cached .. cached+k and returns every position's logits; commit([a_0, ...]) then
keeps, per sequence, the last accepted token and its first a drafts (a+1 tokens): their KDA state and
windows become the slot's, the MLA rows of the rejected positions get their old contents back, and the
runner counts a+1 more cached tokens. Exactly one commit follows each score. For greedy rows,
commit_greedy decides the counts on the device and launches the commit behind the score (no host round trip
between them); the caller reads the argmax ids and counts back in one transfer (started before the commit's
kernels, so the host has them while the commit runs) and hands the counts to `committed`, which does the runner's
bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from k3verify.kernels.pinned import to_device
from k3verify.serving.batch import PackedBatch
from k3verify.serving.kv_cache import CacheError
from k3verify.serving.runner import ModelRunner
from k3verify.serving.spec.accept import greedy_counts
from k3verify.serving.spec.arena import ScoreArena, ScorePass, commit_accepted
from k3verify.serving.staging import PinnedReadback

if TYPE_CHECKING:
    from k3verify.serving.spec.score_graphs import Recorder, ScoreGraphs


@dataclass
class GreedyReadback:
    """commit_greedy's rows on their way to the host: [B, n + 1] (each row's n argmax ids, then its accepted count),
    plus the reject flag as a last column when commit_greedy was given one. The copy is queued before the commit's
    kernels, so `tolist` waits for the acceptance only: the commit runs on while the host uses the ids."""

    host: torch.Tensor  # 1-D; valid once `event` completed (None: a CPU copy, valid now)
    event: torch.cuda.Event | None
    rows: int

    def tolist(self) -> list[list[int]]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.view(self.rows, -1).tolist()


@dataclass
class _Pending:
    seq_ids: list[int]
    slots: torch.Tensor  # [B]
    latent_rows: torch.Tensor  # [B * n]


class SpecScorer:
    def __init__(self, runner: ModelRunner, num_draft: int, max_rows: int, *, fused: bool = False) -> None:
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1; got {num_draft}")
        model = runner.model
        self.runner, self.num_draft, self.num_positions, self.fused = runner, num_draft, num_draft + 1, fused
        self.arena = ScoreArena(model.cfg, max_rows, num_draft + 1, model.dtype, model.device)
        self.max_rows = max_rows
        self._pending: _Pending | None = None
        self._uncounted: list[int] | None = None  # seq_ids committed by commit_greedy, not yet `committed`
        self.readback = PinnedReadback(runner.device)

    @property
    def score_pass(self) -> ScorePass:
        return ScorePass(self.arena, self.num_positions, self.fused)

    @property
    def pending_latent_rows(self) -> torch.Tensor:
        """[B * n] latent-cache rows the pending (scored, not yet committed) pass wrote."""
        if self._pending is None:
            raise RuntimeError("no score is pending")
        return self._pending.latent_rows

    def make_graphs(self, max_context: int, buckets: tuple[int, ...], use_graphs: bool | None = None,
                    recorder: Recorder | None = None) -> ScoreGraphs:
        """Captured score steps over this scorer's arena (CUDA; use_graphs=False runs the same static step;
        `recorder`: how a step is recorded, see serving.spec.score_graphs)."""
        from k3verify.serving.spec.score_graphs import ScoreGraphs

        return ScoreGraphs(self.runner.model, self.arena, max_context, buckets=buckets, fused=self.fused,
                            use_graphs=use_graphs, recorder=recorder)

    def can_score(self, seq_id: int) -> bool:
        """Room left in the sequence's reserved budget for k+1 more positions."""
        r = self.runner
        return 0 < r.num_cached(seq_id) and r.num_cached(seq_id) + self.num_positions <= r.budget(seq_id)

    def score(self, seqs: list[tuple[int, list[int]]], graphs: ScoreGraphs | None = None) -> torch.Tensor:
        """[B, n, V] fp32 logits: row j of sequence b is the prediction after its token j (through `graphs`, a view
        of the captured output: valid until the next score)."""
        if self._pending is not None or self._uncounted is not None:
            raise RuntimeError("score called twice without a commit (and its `committed` counts) in between")
        ids = [sid for sid, _ in seqs]
        if not seqs or len(seqs) > self.max_rows or len(set(ids)) != len(ids):
            raise ValueError(f"score takes 1..{self.max_rows} distinct sequences; got {ids}")
        n, r = self.num_positions, self.runner
        for sid, tokens in seqs:
            if len(tokens) != n:
                raise ValueError(f"sequence {sid}: a score row holds {n} tokens (last + {self.num_draft} drafts); "
                                 f"got {len(tokens)}")
            if not self.can_score(sid):
                raise CacheError(f"sequence {sid}: {r.num_cached(sid)} cached + {n} score positions do not fit its "
                                 f"budget {r.budget(sid)} (or nothing is cached yet)")
        slots, tables = [r.slot_of(sid) for sid in ids], [r.kv_cache.table(sid) for sid in ids]
        starts = [r.num_cached(sid) for sid in ids]
        flat = [t for _, tokens in seqs for t in tokens]
        if graphs is not None:
            if graphs.score_pass.arena is not self.arena or graphs.score_pass.fused != self.fused:
                raise ValueError("these score graphs were made over another arena or score path (make_graphs)")
            logits, slot_t, rows = graphs.score(flat, slots, tables, starts)
        else:
            model = r.model
            batch = PackedBatch.build(torch.tensor(flat, dtype=torch.long), [n] * len(seqs), start_pos=starts,
                                      slots=slots, page_tables=tables, page_size=r.kv_cache.page_size,
                                      device=model.device)
            assert batch.page_table is not None and batch.slots is not None
            rows = r.kv_cache.rows(batch.page_table, batch.seg_ids, batch.positions)
            self.arena.save_latents(r.kv_cache, rows)
            logits, slot_t = model.score(batch, self.score_pass), batch.slots
        self._pending = _Pending(ids, slot_t, rows)
        return logits.view(len(seqs), n, -1)

    def _take_pending(self) -> _Pending:
        pending = self._pending
        if pending is None:
            raise RuntimeError("commit without a score")
        self._pending = None
        return pending

    def _check_counts(self, seq_ids: list[int], accepted: list[int], caller: str) -> None:
        if len(accepted) != len(seq_ids) or any(not 0 <= a <= self.num_draft for a in accepted):
            raise ValueError(f"{caller} needs one count in 0..{self.num_draft} per scored sequence {seq_ids}; "
                             f"got {accepted}")

    def _launch_commit(self, pending: _Pending, accepted: torch.Tensor) -> None:
        commit_accepted(self.runner.state_pool, self.runner.kv_cache, self.arena, pending.slots, accepted,
                        pending.latent_rows)

    def _mark_cached(self, seq_ids: list[int], accepted: list[int]) -> None:
        for sid, a in zip(seq_ids, accepted, strict=True):
            self.runner.mark_cached(sid, a + 1)

    def commit(self, accepted: list[int]) -> None:
        """accepted[b] in 0..k: drafts of row b that were accepted (its last token + those drafts are kept)."""
        if self._pending is not None:
            self._check_counts(self._pending.seq_ids, accepted, "commit")
        pending = self._take_pending()
        self._launch_commit(pending, to_device(accepted, pending.slots.device))
        self._mark_cached(pending.seq_ids, accepted)

    def commit_greedy(self, logits: torch.Tensor, drafts: list[list[int]], reject: torch.Tensor | None = None
                      ) -> GreedyReadback:
        """Greedy acceptance of the pending score on the device (acceptance.greedy_counts) and its commit launched
        behind it. logits [B, n, V] as score returned them, drafts [B][k]; `reject` [B] bool (device): rows that
        accept nothing whatever their argmax (the engine's rows with non-finite logits). Returns the readback of
        [B, n + 1] int64: each row's n argmax ids, then its accepted count (then its reject flag, with `reject`);
        read it (one transfer, already under way), then `committed`."""
        if self._pending is not None and len(drafts) != len(self._pending.seq_ids):
            raise ValueError(f"commit_greedy needs the drafts of every scored sequence {self._pending.seq_ids}; "
                             f"got {len(drafts)} rows")
        pending = self._take_pending()
        best = logits.argmax(dim=-1)  # [B, n]
        flat = [t for row in drafts for t in row]
        if len(flat) != len(drafts) * self.num_draft:
            raise ValueError(f"each row needs {self.num_draft} drafts; got {[len(r) for r in drafts]}")
        accepted = greedy_counts(best, to_device(flat, best.device).view(len(drafts), self.num_draft))
        if reject is not None:
            accepted = accepted.masked_fill(reject, 0)
        columns = [best, accepted[:, None]] + ([] if reject is None else [reject[:, None].long()])
        host, event = self.readback.start(torch.cat(columns, dim=1).view(-1))  # queued before the commit
        self._launch_commit(pending, accepted)
        self._uncounted = pending.seq_ids
        return GreedyReadback(host, event, len(drafts))

    def committed(self, accepted: list[int]) -> None:
        """After commit_greedy: the counts read back (the runner counts a+1 more cached tokens per row)."""
        seq_ids = self._uncounted
        if seq_ids is None:
            raise RuntimeError("committed without a commit_greedy")
        self._check_counts(seq_ids, accepted, "committed")
        self._uncounted = None
        self._mark_cached(seq_ids, accepted)
