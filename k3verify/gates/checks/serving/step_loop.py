"""The engine's step loop against offline greedy decoding (CPU and CUDA).

The engine runs four prompts at once with a per-step budget small enough that the long prompts are cut
into chunks that share steps with the running decodes, launches step n+1 before it reads step n's tokens,
samples on the device and feeds each decode from the token stored by slot on the device (CUDA graphs on
CUDA, the same static step eagerly on CPU). Its greedy tokens must equal a plain offline loop's: whole-
prompt prefill, then one decode per token with host-side argmax. fp32 model; the offline loop records the
smallest top-2 logit gap it met, and a gap too small to rule out a rounding flip is an error (choose other
prompts), never a pass or a fail. A second check holds the engine's device-side logprobs (chosen token and
the 4 best, every step) to the offline log-softmax: faults that move logits without flipping a greedy
token show there. Control of both: the offline run of the same prompts with each prompt's last token lost
(what a chunk boundary that drops a token produces).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3verify.gates import CheckContext, Kind, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.engine_run import collect_events
from k3verify.serving.engine import Engine
from k3verify.serving.graphs import GraphDecoder, engine_buckets
from k3verify.serving.runner import ModelRunner
from k3verify.serving.sampler import SamplingParams
from k3verify.tokenizer import default_tokenizer

LENGTHS = (5, 17, 70, 33)
NEW_TOKENS = 8
TOP = 4  # logprobs asked per token: the chosen one and the 4 best
STEP_TOKENS = 24  # < the long prompts: they are chunked, and chunks share steps with decodes
MIN_GAP = 1e-4  # fp32 logits move ~1e-6 with packing; a top-2 gap 100x wider cannot flip


@dataclass
class Greedy:
    tokens: torch.Tensor  # [S, N] int64
    logprobs: torch.Tensor  # [S, N, 1 + TOP] fp32: the chosen token's, then the TOP best
    min_gap: float = float("inf")


def offline_greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> Greedy:
    """Whole-prompt packed prefill, then host-side argmax and one decode per token."""
    ids = list(range(len(prompts)))
    for sid, p in zip(ids, prompts, strict=True):
        runner.admit(sid, len(p) + new_tokens)
    gap = float("inf")
    toks: list[torch.Tensor] = []
    lps: list[torch.Tensor] = []
    try:
        logits = runner.prefill(list(zip(ids, prompts, strict=True)))
        for step in range(new_tokens):
            logp = torch.log_softmax(logits.float(), dim=-1).cpu()
            top = torch.topk(logp, max(TOP, 2), dim=-1).values
            gap = min(gap, float((top[:, 0] - top[:, 1]).min()))
            toks.append(logp.argmax(-1))
            lps.append(torch.cat([logp.gather(1, toks[-1][:, None]), top[:, :TOP]], dim=1))
            if step + 1 < new_tokens:
                logits = runner.decode(list(zip(ids, toks[-1].tolist(), strict=True)))
    finally:
        for sid in ids:
            runner.release(sid)
    return Greedy(torch.stack(toks, 1), torch.stack(lps, 1), gap)


def engine_greedy(runner: ModelRunner, graphs: GraphDecoder, prompts: list[list[int]], new_tokens: int,
                  step_tokens: int) -> Greedy:
    """The real Engine thread over `runner`: every prompt submitted at once, greedy, eos ignored, logprobs."""
    cfg = runner.model.cfg
    engine = Engine(runner, default_tokenizer(), eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size,
                    max_step_tokens=step_tokens, graphs=graphs).start()
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP)
        events = collect_events(engine, [(p, params) for p in prompts], timeout_s=300)
        engine.check_integrity()
    finally:
        engine.stop()
    errors = [e.error for evs in events for e in evs if e.error is not None]
    if errors:
        raise RuntimeError(f"the engine failed a request: {errors[0]}")
    toks = torch.tensor([[t for e in evs for t in e.token_ids] for evs in events])
    lps = torch.tensor([[[lp.logprob, *(v for _, v in lp.top)] for e in evs for lp in e.logprobs] for evs in events])
    return Greedy(toks, lps)


@dataclass
class StepLoopRun:
    reference: Greedy
    candidate: Greedy
    control: Greedy
    captures: int
    graphs: bool


def step_loop_run(ctx: CheckContext) -> StepLoopRun:
    """One engine run and its offline references, shared by both checks of this module."""
    def build() -> StepLoopRun:
        model = builders.serving_model(ctx, torch.float32)
        runner = ModelRunner(model, num_pages=64, page_size=16, num_slots=len(LENGTHS), max_context=128)
        prompts = [builders.prompt(ctx, n, salt=40 + i).tolist() for i, n in enumerate(LENGTHS)]
        ref = offline_greedy(runner, prompts, NEW_TOKENS)
        if ref.min_gap < MIN_GAP:
            raise RuntimeError(f"the offline trajectories meet a top-2 logit gap of {ref.min_gap:.2e} < {MIN_GAP}: "
                               "a rounding flip cannot be ruled out; choose other prompts")
        graphs = GraphDecoder(model, runner.max_context, buckets=engine_buckets(len(LENGTHS)))
        cand = engine_greedy(runner, graphs, prompts, NEW_TOKENS, STEP_TOKENS)
        ctrl = offline_greedy(runner, [p[:-1] for p in prompts], NEW_TOKENS)
        return StepLoopRun(ref, cand, ctrl, graphs.captures, graphs.use_graphs)

    if "serving.step_loop.run" not in ctx.cache:
        ctx.cache["serving.step_loop.run"] = build()
    run: StepLoopRun = ctx.cache["serving.step_loop.run"]
    return run


def _notes(run: StepLoopRun) -> list[str]:
    return [f"prompts {list(LENGTHS)}, {NEW_TOKENS} tokens, {STEP_TOKENS} tokens per step; graphs={run.graphs} "
            f"({run.captures} captures)"]


@register_check(id="serving.engine.step_loop_vs_offline", component="serving", level="serving",
                kind=Kind.BITEXACT, control="offline tokens of the same prompts with their last token lost")
@builders.single_thread
def check_step_loop_vs_offline(ctx: CheckContext) -> Trial:
    run = step_loop_run(ctx)
    return Trial(reference=run.reference.tokens, candidate=run.candidate.tokens, control=run.control.tokens,
                 metrics={"min_top2_gap": run.reference.min_gap}, notes=_notes(run))


@register_check(id="serving.engine.step_loop_logprobs", component="serving", level="serving", kind=Kind.RMS,
                bar=1e-4, bar_reason="fp32 on both sides: chunking and packing move logprobs by 1e-7..6e-6 relative "
                                     "(measured on the four CPU presets), >= 16x below the bar",
                control="offline logprobs of the same prompts with their last token lost")
@builders.single_thread
def check_step_loop_logprobs(ctx: CheckContext) -> Trial:
    """The engine's device-side logprobs (chosen token + top 4) equal the offline log-softmax at every step:
    a fault that moves logits without flipping a greedy token (a position off by one) shows here."""
    run = step_loop_run(ctx)
    return Trial(reference=run.reference.logprobs, candidate=run.candidate.logprobs, control=run.control.logprobs,
                 position_dim=1, notes=_notes(run))
