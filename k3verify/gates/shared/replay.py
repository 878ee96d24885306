"""CUDA-graph replay against the same step run eagerly, on live caches (serving.graph.* checks, bench), and
the rerun recorder: a stand-in graph for the score steps on any device (spec.verify.graph_vs_eager on CPU)."""

from __future__ import annotations

from collections.abc import Callable

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


class RerunStep:
    """A stand-in for a CUDA graph on any device: each replay runs the recorded step again over whatever its
    static buffers hold now and writes the results into the tensors the recording returned (a graph's outputs
    live at fixed addresses). It reproduces the faults of static-buffer bookkeeping (an input that is not
    refilled, refilled after the replay, a caller reading an output after the next replay, host state a harness
    forgot to rewind), not those of a real capture (host values baked in, stream order, graph-pool reuse)."""

    def __init__(self, step: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        self.step = step
        self.outputs = step()  # the recording: run over the capture's scratch rows, as a warm-up is
        self.replays = 0

    def replay(self) -> None:
        for dst, src in zip(self.outputs, self.step(), strict=True):
            dst.copy_(src)
        self.replays += 1


def rerun_recorder(step: Callable[[], tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[RerunStep, tuple[torch.Tensor, torch.Tensor]]:
    """serving.spec.score_graphs.Recorder that records a RerunStep (the CPU checks' and tests' graph). Its recording
    run is what a CUDA recorder's warm-ups are: one step over the capture's scratch rows."""
    recorded = RerunStep(step)
    return recorded, (recorded.outputs[0], recorded.outputs[1])
