"""The controlled drafter's reference: the speculative path's own greedy continuation, found before timing.

In bf16 on random weights the top-2 logit gaps are tiny, so a score pass (k+1 positions per row, other GEMM
shapes) and a plain decode step (1 position) can pick different argmaxes. After the first such flip the
speculative trajectory leaves the plain one, and a drafter that proposes the plain continuation is wrong at
every later position whatever its nominal acceptance (the measured acceptance then falls far below the
nominal one).

`converge_reference` finds the fixed point instead: ref_0 = the plain continuation; run the speculative
generation with ref_i (untimed); if its tokens equal ref_i's continuation for every sequence, ref_i is the
reference; else ref_{i+1} = prompt + the run's tokens. Each iteration moves every sequence's first divergence
strictly later when the run is deterministic and causal (the tokens before the divergence and the score
windows that produced them are the same, so the argmax at the divergence is reproduced and is now drafted),
so new_tokens iterations suffice; a run that breaks that (other rows of a batch changing a row's MoE GEMM
shapes, say) can fail to converge, which the result says.

Acceptance: "nominal" p is the per-draft probability that the drafter proposes the reference token (each
draft is independently replaced by a different token with probability 1 - p). "Measured" is SpecRun.acceptance:
accepted drafts / proposed drafts (k per score row). Greedy acceptance stops at the first rejected draft, so
with a converged reference the accepted prefix per score averages sum_{i=1..k} p^i and the measured rate is
expected to be that / k (`expected_acceptance`): 59% at nominal 80% with k = 4, 23% at nominal 50%.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecReference:
    references: dict[int, list[int]]  # prompt index -> prompt + continuation
    iterations: int  # untimed speculative runs made
    converged: bool  # the last run reproduced its own reference token for token, for every sequence


def expected_acceptance(p: float, num_draft: int) -> float:
    """Accepted / proposed drafts of greedy scoring when each draft is right with probability p,
    independently: the accepted prefix averages sum_{i=1..k} p^i of the k drafts."""
    if not 0.0 <= p <= 1.0 or num_draft < 1:
        raise ValueError(f"need p in [0, 1] and num_draft >= 1; got {p}, {num_draft}")
    return sum(p ** i for i in range(1, num_draft + 1)) / num_draft


def continuation_match(tokens: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]],
                       references: Mapping[int, Sequence[int]]) -> float:
    """Fraction of generated tokens equal to the reference continuation at the same position."""
    same = total = 0
    for i, (out, prompt) in enumerate(zip(tokens, prompts, strict=True)):
        ref = references[i][len(prompt):]
        same += sum(a == b for a, b in zip(out, ref, strict=False))
        total += len(out)
    return same / total if total else float("nan")


def converge_reference(run_with: Callable[[dict[int, list[int]]], list[list[int]]],
                       prompts: Sequence[Sequence[int]], start: Mapping[int, Sequence[int]],
                       max_iterations: int) -> SpecReference:
    """Iterate ref_{i+1} = prompt + run_with(ref_i) until a run reproduces its reference or max_iterations runs
    were made. `run_with(refs)` is the untimed speculative generation with a drafter built on refs; it returns
    the generated tokens per prompt. Not converged: the newest candidate (never checked) is returned."""
    if max_iterations < 0:
        raise ValueError(f"max_iterations must be >= 0; got {max_iterations}")
    refs = {i: list(start[i]) for i in range(len(prompts))}
    for n in range(1, max_iterations + 1):
        tokens = run_with(refs)
        if all(out == refs[i][len(p):len(p) + len(out)] for i, (out, p) in enumerate(zip(tokens, prompts,
                                                                                          strict=True))):
            return SpecReference(refs, n, True)
        refs = {i: list(p) + list(out) for i, (p, out) in enumerate(zip(prompts, tokens, strict=True))}
    return SpecReference(refs, max_iterations, False)
