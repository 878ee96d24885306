"""One engine step on the device, in two halves: `launch` a StepPlan, later `collect` its token ids.

launch: the plan's prompt chunks as one packed prefill (replayed from a CUDA graph when prefill graphs are given and
every chunk starts its sequence), then one decode of every decodable sequence (through
the CUDA graphs when given; inputs gathered by slot on the device), sampling on the device (the sampler
contract), the sampled ids stored as each sequence's next input on the device, and one pinned device->host
copy of [ids | non-finite flags] (plus logprobs when a row asked). Nothing in launch waits for the GPU on
the decode path, so the engine launches step n+1 before it collects step n: the host's bookkeeping,
detokenization and the next step's input preparation overlap the GPU's work on the step in flight.

A sequence that a stop token ends at step n was already launched again at step n+1 (its row is dropped on
collect). That extra step stays inside its reservation (it had fewer than max_new_tokens tokens) and, as
every later use of its slot and pages is issued after it on the same stream, cannot touch another sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.prefill_graphs import GraphPrefill
from k3verify.serving.request import Request
from k3verify.serving.runner import ModelRunner
from k3verify.serving.sampler import SamplingParams, TokenLogprob, apply_logit_bias, sample_tokens
from k3verify.serving.scheduler import StepPlan
from k3verify.serving.staging import HostStaging, PinnedReadback

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowResult:
    """One sampled row as the host sees it."""

    seq_id: int
    token: int
    nonfinite: bool  # the logits row held NaN or +inf (or nothing finite to sample from)
    logprob: TokenLogprob | None
    error: str | None = None  # sampling this row raised: its request fails alone


@dataclass
class LaunchedStep:
    """A step whose results are on their way to the host."""

    seq_ids: list[int]
    num_top: list[int | None]  # per row: logprobs asked (k alternatives) or None
    ids: torch.Tensor  # host [2n] int64 once `event` completed: tokens, then non-finite flags
    event: Any  # torch.cuda.Event | None (CPU: the copy was synchronous)
    top_ids: torch.Tensor | None = None  # host [n * k] int64
    top_vals: torch.Tensor | None = None  # host [n + n * k] fp32: chosen logprob, then the k best
    num_prefill_tokens: int = 0
    num_decode: int = 0
    errors: list[str | None] = field(default_factory=list)  # per row: why sampling it failed, if it did


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[n] bool on the device: rows whose max is NaN or +inf, or whose every entry is -inf (nothing to sample).
    One reduction: torch.amax propagates NaN."""
    return ~torch.isfinite(torch.amax(logits, dim=-1))


class StepLauncher:
    def __init__(self, runner: ModelRunner, graphs: GraphDecoder | None = None,
                 prefill_graphs: GraphPrefill | None = None) -> None:
        self.runner, self.graphs, self.prefill_graphs = runner, graphs, prefill_graphs
        self.device = runner.device
        self.staging = HostStaging(self.device)
        self.readback = PinnedReadback(self.device)

    def launch(self, plan: StepPlan, requests: Mapping[int, Request]) -> LaunchedStep | None:
        """Launch the plan's work; None when it samples nothing (only intermediate prompt chunks)."""
        rows: list[Request] = []
        parts: list[torch.Tensor] = []
        if plan.prefill:
            run = [c for c in plan.prefill if c.end > c.start]  # an empty chunk: a whole prompt from the cache
            logits = None
            if run:
                seqs = [(c.seq.seq_id, c.tokens) for c in run]
                logits = self.runner.prefill(seqs) if self.prefill_graphs is None else \
                    self.runner.prefill(seqs, self.prefill_graphs)
                if self.runner.prefix is not None:
                    self.runner.prefix.after_prefill(self.runner, [(c.seq.seq_id, c.end, c.is_last) for c in run],
                                                     logits)
            last = [i for i, c in enumerate(run) if c.is_last]
            if logits is not None and last:
                parts.append(logits if len(last) == len(run) else logits.index_select(0, self.staging.to_device(last)))
                rows += [requests[run[i].seq.seq_id] for i in last]
            cached = [c for c in plan.prefill if c.end == c.start]
            if cached:
                parts.append(torch.stack([c.seq.cached_logits.to(self.device) for c in cached]))
                rows += [requests[c.seq.seq_id] for c in cached]
        if plan.decode:
            parts.append(self.runner.decode_next([s.seq_id for s in plan.decode], self.graphs))
            rows += [requests[s.seq_id] for s in plan.decode]
        if not rows:
            return None
        n = len(rows)
        keys = self.staging.to_device([r.seed for r in rows] + [len(r.prompt_ids) + r.num_launched - 1 for r in rows])
        tokens, bad, errors, start = [], [], [], 0
        for part in parts:
            k = part.shape[0]
            flags = nonfinite_rows(part)
            drawn, why = self._sample(part, flags, [r.params for r in rows[start:start + k]], keys[start:start + k],
                                      keys[n + start:n + start + k])
            tokens.append(drawn)
            bad.append(flags)
            errors += why
            start += k
        token_ids = tokens[0] if len(tokens) == 1 else torch.cat(tokens)
        seq_ids = [r.seq_id for r in rows]
        self.runner.set_next_tokens(seq_ids, token_ids)
        host, event = self.readback.start(torch.cat([token_ids, *(b.long() for b in bad)]))
        step = LaunchedStep(seq_ids, [r.params.logprobs for r in rows], host, event,
                            num_prefill_tokens=sum(c.end - c.start for c in plan.prefill),
                            num_decode=len(plan.decode), errors=errors)
        if any(k is not None for k in step.num_top):
            self._launch_logprobs(step, parts, token_ids)
        return step

    @staticmethod
    def _sample(logits: torch.Tensor, bad: torch.Tensor, params: Sequence[SamplingParams], seeds: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, list[str | None]]:
        """[k] tokens and per-row errors. logit_bias moves the choice only (logprobs and the non-finite check
        see the raw logits); a poisoned row must not poison a batched draw, so sampled batches draw from rows
        with non-finite rows zeroed (greedy argmax is per row). If the batched draw raises, rows are drawn one
        by one and only a row that raises is marked."""
        safe = logits if all(p.is_greedy for p in params) else logits.float().masked_fill(bad[:, None], 0.0)
        try:
            return sample_tokens(apply_logit_bias(safe, params), params, seeds, positions), [None] * len(params)
        except Exception:
            log.exception("batched sampling failed; sampling row by row to find the request at fault")
        tokens: list[torch.Tensor] = []
        errors: list[str | None] = []
        for i, p in enumerate(params):
            try:
                tokens.append(sample_tokens(apply_logit_bias(safe[i:i + 1], [p]), [p], seeds[i:i + 1],
                                            positions[i:i + 1]))
                errors.append(None)
            except Exception as exc:
                log.exception("sampling failed for row %d", i)
                tokens.append(torch.zeros(1, dtype=torch.long, device=logits.device))
                errors.append(f"sampling failed: {type(exc).__name__}: {exc}")
        return torch.cat(tokens), errors

    def _launch_logprobs(self, step: LaunchedStep, parts: list[torch.Tensor], tokens: torch.Tensor) -> None:
        """Chosen-token logprob and the k best (k = the largest any row asked) of every row, on the device."""
        k = max(int(t or 0) for t in step.num_top)
        logp = torch.cat([torch.log_softmax(p.float(), dim=-1) for p in parts])
        k = min(k, logp.shape[-1])
        chosen = logp.gather(1, tokens[:, None]).view(-1)
        top = torch.topk(logp, k, dim=-1)
        step.top_ids, event = self.readback.start(top.indices.reshape(-1))
        step.top_vals, step.event = self.readback.start(torch.cat([chosen, top.values.reshape(-1)]))

    @staticmethod
    def collect(step: LaunchedStep) -> list[RowResult]:
        """Wait for the step's copies and turn them into per-row results."""
        if step.event is not None:
            step.event.synchronize()
        n = len(step.seq_ids)
        ids = step.ids.tolist()
        tokens, bad = ids[:n], ids[n:2 * n]
        lps: list[TokenLogprob | None] = [None] * n
        if step.top_vals is not None and step.top_ids is not None:
            vals, top_ids = step.top_vals.tolist(), step.top_ids.tolist()
            k = (len(vals) - n) // n
            for i, want in enumerate(step.num_top):
                if want is not None:
                    j = min(want, k)
                    pairs = tuple(zip(top_ids[i * k:i * k + j], vals[n + i * k:n + i * k + j], strict=True))
                    lps[i] = TokenLogprob(tokens[i], vals[i], pairs)
        errors = step.errors or [None] * n
        return [RowResult(sid, tok, bool(b), lp, err) for sid, tok, b, lp, err in zip(step.seq_ids, tokens, bad, lps,
                                                                                       errors, strict=True)]
