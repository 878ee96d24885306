"""CUDA-graph replay against the same decode step run eagerly, on live caches (serving.graph.* checks, bench)."""

from __future__ import annotations

import torch

from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.runner import ModelRunner


def replay_vs_eager(runner: ModelRunner, graphs: GraphDecoder, prompts: list[list[int]], steps: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decode `steps` tokens for `prompts` through the graphs; before each step the same static step
    runs eagerly from a snapshot of the caches (then restored). Returns (eager, graph, control) logits
    [steps, B, V]; the control replays the captured graph over the previous step's static inputs.
    Sequences are admitted and released here."""
    eager = GraphDecoder(runner.model, graphs.max_context, buckets=graphs.buckets, use_graphs=False)
    B = len(prompts)
    base = max(runner.active_ids, default=-1) + 1
    ids = list(range(base, base + B))
    for sid, p in zip(ids, prompts, strict=True):
        runner.admit(sid, len(p) + steps + 1)
    refs, cands, ctrls = [], [], []
    pool, kv = runner.state_pool.tensors(), runner.kv_cache
    try:
        toks = runner.prefill(list(zip(ids, prompts, strict=True))).argmax(-1).tolist()
        for _ in range(steps):
            snap = ({k: v.clone() for k, v in pool.items()}, kv.data.clone())

            def restore(snap: tuple[dict[str, torch.Tensor], torch.Tensor] = snap) -> None:
                for k, v in snap[0].items():
                    pool[k].copy_(v)
                kv.data.copy_(snap[1])

            refs.append(eager.decode(toks, *runner.decode_args(ids)))
            restore()
            stale = graphs.replay_stale(B)  # stale inputs: last step's tokens and positions
            if stale is not None:
                ctrls.append(stale)
                restore()
            cands.append(runner.decode(list(zip(ids, toks, strict=True)), graphs))
            toks = cands[-1].argmax(-1).tolist()
    finally:
        for sid in ids:
            runner.release(sid)
    control = torch.stack(ctrls) if len(ctrls) == steps - 1 else None
    return torch.stack(refs), torch.stack(cands), control
