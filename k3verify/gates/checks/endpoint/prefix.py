"""Endpoint check on shared prompt prefixes: what any server that caches prefixes (or does not) is held to.

Prompts that share a prefix are sent interleaved, some of them repeated: a prefix with two different suffixes, the
prefix alone (its match ends exactly where the cached prompts branch off), a prompt that leaves the prefix in the
middle of a KDA chunk block, one equal to the prefix up to a single token inside its last block, a prompt shorter
than any block, and that short prompt with a suffix. The first prompt of each family is sent before anything that
shares its ids (fresh random ids: no server can hold them), so its answer is cold; every later answer may be served
from a cache. For this architecture a cache must restore the KDA recurrent state and conv windows at exactly the
position its match ends, and the MLA latents of that prefix only: a state from the neighbouring block, a window from
the wrong position, the state after an earlier answer, or a block matched by its own tokens under another prefix
all answer fluently and wrongly.

Every answer is judged token by token against the oracle on its own tokens (teacher forcing, near-ties excused as
in endpoint.greedy.tokens), and every repeat must answer what the prompt's first answer did, id for id (a
difference at an oracle near-tie is reported, not failed). A last round sends the branched prompts together, up to
the concurrency limit, while they share the cached prefix."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.endpoint_common import as_ids, greedy_body, plain_vocab, session
from k3verify.gates.shared.endpoint_oracle import judge_tokens, score, shifted_control

BLOCK = 64  # the KDA chunk grid: the block of every prefix cache for this architecture we know, or a divisor of it
SHORT = 3  # tokens: shorter than any block or state-checkpoint spacing


@dataclass(frozen=True)
class Family:
    """The prompts of one check run by name, and the order they are sent in (names may repeat)."""

    prompts: dict[str, list[int]]
    order: list[str]
    together: list[str]  # sent at once in the last round


def family(ctx: CheckContext) -> Family:
    g = torch.Generator().manual_seed(ctx.seed * 104_729 + 47)

    def ids(n: int) -> list[int]:
        return torch.randint(0, plain_vocab(ctx), (n,), generator=g).tolist()

    prefix = ids(2 * BLOCK - 20)  # one whole block, then 44 tokens of the next
    flipped = list(prefix)
    flipped[BLOCK + 36] = (flipped[BLOCK + 36] + 1) % plain_vocab(ctx)
    short = ids(SHORT)
    prompts = {
        "prefix+a": prefix + ids(5),
        "short": short,
        "prefix+b": prefix + ids(9),
        "prefix": list(prefix),
        "mid-block": prefix[: BLOCK + 32] + ids(12),
        "short+a": short + ids(4),
        "one-token-off": flipped,
    }
    order = ["prefix+a", "short", "prefix+b", "short", "prefix", "mid-block", "prefix+a", "short+a",
             "one-token-off", "prefix+b", "prefix", "short"]
    return Family(prompts, order, ["prefix+a", "prefix+b", "mid-block", "prefix", "one-token-off"])


def _shared(prompts: dict[str, list[int]], name: str, sent: list[str]) -> int:
    """The longest prefix `name` shares with a prompt sent before it."""
    best, mine = 0, prompts[name]
    for other in sent:
        theirs = prompts[other]
        n = next((p for p, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs)))
        best = max(best, n)
    return best


@register_check(
    id="endpoint.prefix.reuse", component="endpoint", level="serving", kind=Kind.BITEXACT,
    control="an answer with one id shifted by one (at the middle position that agreed)",
)
@builders.single_thread
def check_prefix_reuse(ctx: CheckContext) -> Trial:
    ep = session(ctx)
    if not ep.caps.completions.available:
        raise SkipCheck(f"the endpoint cannot serve token-id prompts with logprobs: {ep.caps.completions.reason}")
    fam = family(ctx)
    body = greedy_body(ctx)
    answers: list[tuple[str, list[int]]] = [(name, ep.complete(fam.prompts[name], **body).resolved_ids())
                                            for name in fam.order]
    with ThreadPoolExecutor(max_workers=max(1, ep.client.limits.concurrency)) as pool:
        futures = [(name, pool.submit(ep.complete, fam.prompts[name], **body)) for name in fam.together]
        answers += [(name, f.result().resolved_ids()) for name, f in futures]
    ref, cand, ctrl, notes = {}, {}, {}, []
    first: dict[str, list[int]] = {}
    differing = excused = 0
    for k, (name, tokens) in enumerate(answers):
        prompt = fam.prompts[name]
        sent = [n for n, _ in answers[:k]]
        where = "together" if k >= len(fam.order) else "alone"
        label = (f"request {k} ({where}): prompt {name} ({len(prompt)} tokens, {_shared(fam.prompts, name, sent)} "
                 "shared with an earlier prompt)")
        if not tokens:
            notes.append(f"{label}: no identifiable token in the answer; not compared")
            continue
        scores = score(ctx, prompt + tokens, len(prompt))
        verdicts = judge_tokens(scores, tokens, label)
        notes += verdicts.failures + verdicts.excused
        key = f"request{k}.{name}"
        ref[key], cand[key] = as_ids(verdicts.reference), as_ids(tokens)
        ctrl[key] = as_ids(shifted_control(tokens, verdicts.reference, ctx.cfg.vocab_size))
        if name not in first:
            first[name] = tokens
            continue
        before = first[name]
        n = min(len(before), len(tokens))
        d = next((p for p in range(n) if before[p] != tokens[p]), None)
        if d is not None:
            differing += 1
            gap = abs(float(scores.gold[d, before[d]] - scores.gold[d, tokens[d]]))
            if gap <= scores.tie_threshold(d):
                excused += 1
                notes.append(f"{label}: answers {tokens[d]} at position {d} where its first answer had {before[d]}, "
                             f"at an oracle near-tie (gap {gap:.3g}): reported, not failed")
                n = d
            else:
                notes.append(f"{label}: answers {tokens[d]} at position {d} where its first answer had {before[d]} "
                             f"(oracle gap {gap:.3g}): a cached prefix served a different state")
        ref[f"{key}.same"], cand[f"{key}.same"] = as_ids(before[:n]), as_ids(tokens[:n])
        ctrl[f"{key}.same"] = as_ids(shifted_control(before[:n], before[:n], ctx.cfg.vocab_size))
    notes.append(f"{len(fam.order)} greedy requests one at a time ({len(fam.prompts)} prompts sharing prefixes, block "
                 f"{BLOCK}, repeats interleaved), then {len(fam.together)} together; every answer judged against the "
                 "oracle, every repeat against the prompt's first answer")
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=notes,
                 metrics={"requests": len(answers), "differing_repeats": differing, "excused_near_ties": excused})
