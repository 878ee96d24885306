"""Endpoint check on a repeated request: the same greedy request sent again, right after the first, answers the
same. A server that caches prompt prefixes serves the repeat from its cache; for this architecture that means
restoring the KDA recurrent state and conv windows at the end of the prompt, which a cache keyed on tokens alone
can get wrong (the state after the prompt and its answer is not the state after the prompt). Short prompts are the
hard case for servers that checkpoint the state only every so many tokens, so both a prompt of three tokens and
the first greedy prompt are repeated."""

from __future__ import annotations

import torch

from k3verify.gates import CheckContext, Kind, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.endpoint_common import as_ids, greedy_answers, greedy_body, plain_vocab, session
from k3verify.gates.shared.endpoint_oracle import score, shifted_control

SHORT_PROMPT = 3  # tokens: shorter than the state-checkpoint spacing of any server we know


@register_check(
    id="endpoint.repeat.identity", component="endpoint", level="serving", kind=Kind.BITEXACT,
    control="the repeated answer with one id shifted by one (at the middle position that agreed)",
)
@builders.single_thread
def check_repeat_identity(ctx: CheckContext) -> Trial:
    ep = session(ctx)
    g = torch.Generator().manual_seed(ctx.seed * 7919 + 3)
    short = torch.randint(0, plain_vocab(ctx), (SHORT_PROMPT,), generator=g).tolist()
    prompts = [short, greedy_answers(ctx)[0].prompt]
    ref, cand, ctrl, notes = {}, {}, {}, []
    for i, prompt in enumerate(prompts):
        first = ep.complete(prompt, **greedy_body(ctx)).resolved_ids()
        again = ep.complete(prompt, **greedy_body(ctx)).resolved_ids()
        n = min(len(first), len(again))
        d = next((p for p in range(n) if first[p] != again[p]), None)
        if d is not None:
            scores = score(ctx, prompt + first, len(prompt))
            gap = abs(float(scores.gold[d, first[d]] - scores.gold[d, again[d]]))
            if gap <= scores.tie_threshold(d):
                notes.append(f"prompt {i}: the repeat differs at position {d} at an oracle near-tie (gap {gap:.3g}): "
                             "reported, not failed")
                n = d
            else:
                notes.append(f"prompt {i} ({len(prompt)} tokens): the repeat answers {again[d]} at position {d} where "
                             f"the first answer had {first[d]} (oracle gap {gap:.3g}): a cached prefix served a "
                             "different state")
        key = f"prompt{i}"
        ref[key], cand[key] = as_ids(first[:n]), as_ids(again[:n])
        ctrl[key] = as_ids(shifted_control(first[:n], first[:n], ctx.cfg.vocab_size))
    notes.append(f"each of {len(prompts)} greedy requests (prompts of {', '.join(str(len(p)) for p in prompts)} "
                 "tokens) sent twice in a row; the second answer must equal the first")
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=notes)
