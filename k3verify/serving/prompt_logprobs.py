"""Prompt logprobs (echo=true with logprobs): every prompt token's logprob given the tokens before it, by the served
model in one cacheless pass over the prompt (the packed-prefill path). Engine.prompt_logprobs runs it on the engine
thread between steps: the runner is not thread-safe."""

from __future__ import annotations

from typing import Any

import torch

from k3verify.serving.batch import PackedBatch
from k3verify.serving.sampler import TokenLogprob, token_logprobs


def prompt_logprobs(model: Any, prompt_ids: list[int], num_top: int) -> list[TokenLogprob | None]:
    """[None, logprob of prompt[1] given prompt[:1], ...] with the num_top most likely tokens at each position."""
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    logits = model.prefill(PackedBatch.build(ids, [len(prompt_ids)], device=model.device), all_logits=True)
    if logits.all_logits is None:
        raise RuntimeError("the served model returned no per-position logits for a prompt-logprobs pass")
    rest = token_logprobs(logits.all_logits[:-1], prompt_ids[1:], [num_top] * (len(prompt_ids) - 1))
    return [None, *rest]
