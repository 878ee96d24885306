"""ModelRunner: the engine-facing API over ServingModel and its two caches.

A sequence is admitted with its full budget (prompt + max new tokens): pages and a KDA state slot are
reserved up front, so a running sequence can never be starved. `prefill` packs any number of admitted
sequences (a sequence may prefill more than once: prefix continuation / chunked prefill), `decode`
advances each by one token. Token positions are tracked here; the scheduler only names seq ids.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from k3verify.config import ModelConfig
from k3verify.serving.batch import SCRATCH, PackedBatch
from k3verify.serving.kv_cache import CacheError
from k3verify.serving.model import ServingModel
from k3verify.serving.prefix_pages import SharedLatentCache
from k3verify.serving.prefix_reuse import PrefixReuse, PrefixSettings
from k3verify.serving.staging import HostStaging

if TYPE_CHECKING:
    from k3verify.serving.graphs import GraphDecoder
    from k3verify.serving.prefill_graphs import GraphPrefill


@dataclass
class SequenceCache:
    """What the runner holds for one admitted sequence: its KDA state slot and cached-token counts."""

    slot: int
    budget: int  # tokens reserved (prompt + max new)
    cached: int = 0  # tokens already run through the model
    cuts: list[int] = field(default_factory=list)  # prompt positions where a prefill (or a cached prefix) ended


class ModelRunner:
    def __init__(self, model: ServingModel, *, num_pages: int, page_size: int, num_slots: int,
                 max_context: int) -> None:
        if max_context < 1:
            raise ValueError(f"max_context must be >= 1; got {max_context}")
        self.model = model
        self.max_context = max_context
        self._cache_shape = (num_pages, page_size, num_slots)
        self._seqs: dict[int, SequenceCache] = {}
        self.prefix: PrefixReuse | None = None  # the prefix cache, once enable_prefix_cache turned it on
        self._allocate_caches()
        # Per state slot, on the device: the page table (pages are reserved whole at admission, so a row is
        # written once) and the token the next decode feeds (written by set_next_tokens from sampled ids).
        # The engine's decode step gathers both by slot instead of sending ids and page lists every step.
        device = model.device
        self.max_pages = self.kv_cache.pages_needed(max_context)
        self.pages_by_slot = torch.full((num_slots + 1, self.max_pages), SCRATCH, dtype=torch.long, device=device)
        self.tokens_by_slot = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
        self.staging = HostStaging(device)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def reset_caches(self) -> None:
        """Forget every sequence and allocate fresh caches (the engine supervisor's restart): nothing a failed
        step left half-written survives. CUDA graphs captured over the old tensors re-capture on their next
        replay (their signature holds the cache data pointers)."""
        self._seqs.clear()
        self._allocate_caches()

    def _allocate_caches(self) -> None:
        self.model.allocate_caches(*self._cache_shape)
        assert self.model.kv_cache is not None and self.model.state_pool is not None
        self.kv_cache, self.state_pool = self.model.kv_cache, self.model.state_pool
        if self.prefix is not None:  # entries name pages and states of the old caches: start empty
            self.enable_prefix_cache(self.prefix.weights, self.prefix.vocab_size, self.prefix.settings)

    def enable_prefix_cache(self, weights: str, vocab_size: int, settings: PrefixSettings) -> PrefixReuse:
        """Reuse cached prompt prefixes from now on (serving/prefix_reuse.py); `weights` names the served weights."""
        if not isinstance(self.kv_cache, SharedLatentCache):
            raise TypeError(f"prefix caching needs a SharedLatentCache; the model allocated {type(self.kv_cache)}")
        self.prefix = PrefixReuse(self.kv_cache, self.state_pool, list(self.model.parameters()), weights,
                                  vocab_size, settings)
        return self.prefix

    @property
    def active_ids(self) -> list[int]:
        return list(self._seqs)

    def num_cached(self, seq_id: int) -> int:
        return self._get(seq_id).cached

    def slot_of(self, seq_id: int) -> int:
        """The KDA state slot an admitted sequence holds."""
        return self._get(seq_id).slot

    def budget(self, seq_id: int) -> int:
        """Tokens reserved for the sequence at admission (prompt + max new)."""
        return self._get(seq_id).budget

    def mark_cached(self, seq_id: int, num_tokens: int) -> None:
        """Count tokens that a pass outside prefill/decode committed to the caches (a speculative score)."""
        seq = self._get(seq_id)
        if num_tokens < 1 or seq.cached + num_tokens > seq.budget:
            raise CacheError(f"sequence {seq_id}: committing {num_tokens} token(s) to {seq.cached} cached exceeds its "
                             f"budget {seq.budget} (or is not positive)")
        seq.cached += num_tokens

    def can_ever_fit(self, num_tokens: int) -> bool:
        return (0 < num_tokens <= self.max_context
                and self.kv_cache.pages_needed(num_tokens) <= self.kv_cache.num_usable_pages)

    @property
    def num_free_slots(self) -> int:
        """State slots free for new sequences."""
        return self.state_pool.num_free

    def can_admit(self, num_tokens: int) -> bool:
        if self.prefix is not None and self.can_ever_fit(num_tokens):
            self.prefix.make_room(self.kv_cache.pages_needed(num_tokens))
        return (self.can_ever_fit(num_tokens) and self.state_pool.num_free >= 1
                and self.kv_cache.pages_needed(num_tokens) <= self.kv_cache.num_free_pages)

    def admit(self, seq_id: int, num_tokens: int, shared: list[int] | None = None, cached: int = 0,
              cuts: tuple[int, ...] = ()) -> None:
        """Reserve `num_tokens` tokens; a prefix-cache hit passes its prefix's pages (`shared`, first in the table),
        how many tokens they and the restored state already hold (`cached`) and where the prefills that made
        them were cut (`cuts`)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already admitted")
        if not self.can_ever_fit(num_tokens):
            raise CacheError(f"sequence {seq_id}: {num_tokens} tokens can never fit (max_context "
                             f"{self.max_context}, {self.kv_cache.num_usable_pages} pages of "
                             f"{self.kv_cache.page_size})")
        if not self.can_admit(num_tokens):
            raise CacheError(f"sequence {seq_id}: {num_tokens} tokens do not fit now "
                             f"({self.kv_cache.num_free_pages} free pages, {self.state_pool.num_free} free slots)")
        if not 0 <= cached < num_tokens:
            raise CacheError(f"sequence {seq_id}: {cached} cached tokens for a budget of {num_tokens}")
        slot = self.state_pool.allocate()
        try:
            if shared:
                assert isinstance(self.kv_cache, SharedLatentCache)
                self.kv_cache.reserve(seq_id, num_tokens, shared=shared)
            else:
                self.kv_cache.reserve(seq_id, num_tokens)
        except CacheError:
            self.state_pool.free(slot)
            raise
        self._seqs[seq_id] = SequenceCache(slot, num_tokens, cached, [*cuts, cached] if cached else [])
        self._stage_table(seq_id)

    def _stage_table(self, seq_id: int) -> None:
        table = self.kv_cache.table(seq_id)
        padded = table + [SCRATCH] * (self.max_pages - len(table))
        self.staging.copy_into(self.pages_by_slot[self.slot_of(seq_id)], padded)

    def own_page(self, seq_id: int, index: int) -> None:
        """Copy the `index`-th page of the sequence's table if it is shared (it is about to write there)."""
        assert isinstance(self.kv_cache, SharedLatentCache)
        self.kv_cache.copy_on_write(seq_id, index)
        self._stage_table(seq_id)

    def release(self, seq_id: int) -> None:
        seq = self._get(seq_id)
        if self.prefix is not None:
            self.prefix.forget(seq_id)
        self.kv_cache.free(seq_id)
        self.state_pool.free(seq.slot)
        del self._seqs[seq_id]

    def prefill(self, seqs: list[tuple[int, list[int]]], graphs: GraphPrefill | None = None) -> torch.Tensor:
        """Pack and run new tokens of admitted sequences -> [n, V] fp32 logits of each one's last token. With
        `graphs`, a pack of fresh sequences that one of its buckets takes is replayed from a CUDA graph (the rest
        run eagerly)."""
        if not seqs:
            raise ValueError("prefill needs at least one sequence")
        states = [self._get(sid) for sid, _ in seqs]
        if len({sid for sid, _ in seqs}) != len(seqs):
            raise ValueError(f"a sequence appears twice in one prefill: {[sid for sid, _ in seqs]}")
        for (sid, tokens), st in zip(seqs, states, strict=True):
            if not tokens:
                raise ValueError(f"sequence {sid}: prefill with no tokens")
            if st.cached + len(tokens) > st.budget:
                raise CacheError(f"sequence {sid}: {st.cached} cached + {len(tokens)} new tokens exceed its "
                                 f"admitted budget of {st.budget}")
        logits = None
        if graphs is not None and all(st.cached == 0 for st in states):
            logits = graphs.prefill([t for _, tokens in seqs for t in tokens], [len(t) for _, t in seqs],
                                    [st.slot for st in states], [self.kv_cache.table(sid) for sid, _ in seqs])
        if logits is None:
            logits = self._prefill_eager(seqs, states)
        for (_, tokens), st in zip(seqs, states, strict=True):
            if st.cached and (not st.cuts or st.cuts[-1] != st.cached):
                st.cuts.append(st.cached)
            st.cached += len(tokens)
        return logits

    def cuts_of(self, seq_id: int) -> tuple[int, ...]:
        """Where the sequence's prompt was cut between prefills (a cached prefix's cuts and its end included): a
        cold prefill cut at the same positions computes the same bits."""
        return tuple(self._get(seq_id).cuts)

    def _prefill_eager(self, seqs: list[tuple[int, list[int]]], states: list[SequenceCache]) -> torch.Tensor:
        ids = torch.tensor([t for _, tokens in seqs for t in tokens], dtype=torch.long)
        batch = PackedBatch.build(ids, [len(t) for _, t in seqs], start_pos=[s.cached for s in states],
                                  slots=[s.slot for s in states],
                                  page_tables=[self.kv_cache.table(sid) for sid, _ in seqs],
                                  page_size=self.kv_cache.page_size, device=self.model.device,
                                  stage=self.staging.to_device)
        return self.model.prefill(batch).logits

    def decode(self, seqs: list[tuple[int, int]], graphs: GraphDecoder | None = None) -> torch.Tensor:
        """One token per sequence (seq_id, last token) -> [n, V] fp32 logits; through `graphs` (captured
        CUDA graphs over the same model and caches) when given, else eagerly."""
        states = self._decodable([sid for sid, _ in seqs])
        args = self.decode_args([sid for sid, _ in seqs])
        if graphs is not None:
            logits = graphs.decode([tok for _, tok in seqs], *args)
        else:
            ids = torch.tensor([tok for _, tok in seqs], dtype=torch.long, device=self.model.device)
            logits = self.model.decode(ids, *args)
        for st in states:
            st.cached += 1
        return logits

    def decode_next(self, seq_ids: list[int], graphs: GraphDecoder | None = None) -> torch.Tensor:
        """One token per sequence, each fed the token set_next_tokens stored for it (on the device) ->
        [n, V] fp32 logits. Through `graphs` the inputs are gathered by slot on the device and the result
        is a view of the graph's output, valid until the next decode of that bucket."""
        states = self._decodable(seq_ids)
        slots, positions = [s.slot for s in states], [s.cached for s in states]
        if graphs is not None:
            limit = graphs.max_context
            longer = [(sid, st.budget) for sid, st in zip(seq_ids, states, strict=True) if st.budget > limit]
            if longer:
                raise CacheError(f"sequence(s) {longer} (id, budget) exceed the graphs' context {graphs.max_context}")
            logits = graphs.decode_slots(slots, positions, self.tokens_by_slot, self.pages_by_slot)
        else:
            ids = self.tokens_by_slot.index_select(0, self.staging.to_device(slots))
            logits = self.model.decode(ids, slots, [self.kv_cache.table(sid) for sid in seq_ids], positions)
        for st in states:
            st.cached += 1
        return logits

    def set_next_tokens(self, seq_ids: list[int], tokens: torch.Tensor | list[int]) -> None:
        """Store the token each sequence feeds on its next decode_next ([n] int64 on the model's device, or
        host ids: a score pass's last emitted token, a follower rank's copy)."""
        if isinstance(tokens, list):
            tokens = self.staging.to_device(tokens)
        if tokens.shape != (len(seq_ids),):
            raise ValueError(f"{tuple(tokens.shape)} tokens for {len(seq_ids)} sequences")
        slots = self.staging.to_device([self._get(sid).slot for sid in seq_ids])
        self.tokens_by_slot.index_copy_(0, slots, tokens.to(torch.long))

    def _decodable(self, seq_ids: list[int]) -> list[SequenceCache]:
        if not seq_ids:
            raise ValueError("decode needs at least one sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one decode: {seq_ids}")
        states = [self._get(sid) for sid in seq_ids]
        for sid, st in zip(seq_ids, states, strict=True):
            if st.cached + 1 > st.budget:
                raise CacheError(f"sequence {sid}: decoding token {st.cached + 1} exceeds its budget {st.budget}")
        return states

    def decode_args(self, seq_ids: list[int]) -> tuple[list[int], list[list[int]], list[int]]:
        """(state slots, page tables, positions) of the next decode step of `seq_ids`, in order."""
        states = [self._get(sid) for sid in seq_ids]
        return [s.slot for s in states], [self.kv_cache.table(sid) for sid in seq_ids], [s.cached for s in states]

    def check_integrity(self) -> None:
        self.kv_cache.check_integrity()
        self.state_pool.check_integrity()
        if self.prefix is not None:
            self.prefix.cache.check_integrity()
        slots = [s.slot for s in self._seqs.values()]
        if len(set(slots)) != len(slots):
            raise CacheError(f"two sequences share a KDA state slot: {slots}")
        if set(slots) != self.state_pool.used_slots:
            raise CacheError(f"state slots in use {sorted(self.state_pool.used_slots)} != slots of running sequences "
                             f"{sorted(slots)}")
        for sid, seq in self._seqs.items():
            if self.kv_cache.capacity(sid) < seq.budget:
                raise CacheError(f"sequence {sid}: {self.kv_cache.capacity(sid)} cached-token capacity for a "
                                 f"budget of {seq.budget}")
            if seq.cached > seq.budget:
                raise CacheError(f"sequence {sid}: {seq.cached} cached tokens exceed its budget {seq.budget}")
        owners = set(self.kv_cache.owners)
        if owners != set(self._seqs):
            raise CacheError(f"page owners {sorted(owners)} != running sequences {sorted(self._seqs)}")
        if isinstance(self.kv_cache, SharedLatentCache):
            self._check_write_targets(self.kv_cache)

    def _check_write_targets(self, kv: SharedLatentCache) -> None:
        """No page a sequence will still write (from the one holding its next position on) is in another
        sequence's table: a prefix's shared pages lie wholly before the position a sequence resumed at."""
        tables = {sid: kv.table(sid) for sid in self._seqs}
        in_tables = Counter(p for t in tables.values() for p in t)
        for sid, seq in self._seqs.items():
            shared = [p for p in tables[sid][seq.cached // kv.page_size:] if in_tables[p] > 1]
            if shared:
                raise CacheError(f"sequence {sid} will write page(s) {shared} that another sequence holds too")

    def _get(self, seq_id: int) -> SequenceCache:
        if seq_id not in self._seqs:
            raise KeyError(f"sequence {seq_id} is not admitted")
        if self.model.kv_cache is not self.kv_cache or self.model.state_pool is not self.state_pool:
            raise RuntimeError("this runner's caches are no longer the model's: another ModelRunner over the same "
                               "model (or allocate_caches) replaced them, and the model would read and write those "
                               "instead (one runner per model at a time)")
        return self._seqs[seq_id]


def build_runner(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", mxfp4_mode: str = "auto", num_pages: int = 256,
                 page_size: int = 16, num_slots: int = 8, max_context: int | None = None) -> ModelRunner:
    """A loaded ServingModel wrapped in a runner (max_context defaults to what the pages can hold)."""
    model = ServingModel(cfg, dtype, device, mxfp4_mode).load(tensors)
    ctx_len = max_context if max_context is not None else min((num_pages - 1) * page_size, cfg.max_position_embeddings)
    return ModelRunner(model, num_pages=num_pages, page_size=page_size, num_slots=num_slots, max_context=ctx_len)


def generate_greedy(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
                    eos_token_ids: Collection[int] | None = None) -> list[list[int]]:
    """Offline greedy decoding: the generated tokens of each prompt (an eos, when given, ends a
    sequence and is included). Admits as many prompts as fit, runs them to completion, repeats."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    stop = set(eos_token_ids or ())
    out: list[list[int]] = [[] for _ in prompts]
    pending = list(range(len(prompts)))
    next_id = max(runner.active_ids, default=-1) + 1
    while pending:
        wave: dict[int, int] = {}  # seq id -> prompt index
        for i in list(pending):
            need = len(prompts[i]) + max_new_tokens
            if not runner.can_ever_fit(need):
                raise CacheError(f"prompt {i} ({len(prompts[i])} tokens) + {max_new_tokens} new can never fit")
            if not runner.can_admit(need):
                break
            runner.admit(next_id, need)
            wave[next_id] = i
            next_id += 1
            pending.remove(i)
        if not wave:
            raise CacheError("no prompt fits into the free cache: release running sequences first")
        try:
            logits = runner.prefill([(sid, list(prompts[i])) for sid, i in wave.items()])
            live = list(wave)
            while live:
                nxt = logits.argmax(dim=-1).tolist()
                still = []
                for sid, tok in zip(live, nxt, strict=True):
                    out[wave[sid]].append(tok)
                    if tok not in stop and len(out[wave[sid]]) < max_new_tokens:
                        still.append((sid, tok))
                live = [sid for sid, _ in still]
                if still:
                    logits = runner.decode(still)
        finally:
            for sid in wave:
                runner.release(sid)
    return out
