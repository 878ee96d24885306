"""CUDA-graph prefill checks (serving/prefill_graphs.py).

- static vs eager (CPU, bit for bit): a pack that needs a filler sequence and an empty one, prefilled through the
  static step (offsets on the device only) right after another pack of the same bucket went through the same
  buffers, against the eager prefill of the same prompts with the filler run as a real sequence (so every GEMM and
  expert group has the same rows): the live sequences' logits, state slots and latent pages, and every other slot
  and page but the scratch ones left as they were (a filler writing a live slot or page shows there). Control: the
  same static step with the earlier pack's offsets left in the buffer (what a graph that baked its capture's
  lengths would compute). On CUDA a row's GEMM bits depend on the row count, and the bench holds the replay to the
  eager prefill by RMS (bench/speed_parity.prefill_graph_parity).
- replay vs static (CUDA): the bucket's graph replayed equals the static step run eagerly, bit for bit. Control:
  a replay whose buffers still hold the previous pack (the prompts reversed).
"""

from __future__ import annotations

import torch

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared.builders import prompt, serving_model
from k3verify.serving.batch import SCRATCH, PackedBatch
from k3verify.serving.prefill_graphs import GraphPrefill, PrefillShape, static_prefill
from k3verify.serving.runner import ModelRunner

PAGE = 16
FIRST = (30, 50, 20)  # bucket (T 128, B 4, L 64): one filler of 28 tokens
SECOND = (50, 40)  # the same bucket: one filler of 38 tokens and one empty sequence
BUCKET = PrefillShape(128, 4, 64)


def _runner(ctx: CheckContext, dtype: torch.dtype) -> ModelRunner:
    return ModelRunner(serving_model(ctx, dtype), num_pages=64, page_size=PAGE, num_slots=8, max_context=256)


def _prompts(ctx: CheckContext, lens: tuple[int, ...], salt: int) -> list[list[int]]:
    return [prompt(ctx, n, salt=salt + i).tolist() for i, n in enumerate(lens)]


def _admit(runner: ModelRunner, prompts: list[list[int]]) -> list[int]:
    first = max(runner.active_ids, default=-1) + 1
    ids = list(range(first, first + len(prompts)))
    for sid, p in zip(ids, prompts, strict=True):
        runner.admit(sid, len(p) + 1)
    return ids


def _two_packs(ctx: CheckContext, dtype: torch.dtype, graphs_on: bool
               ) -> tuple[ModelRunner, GraphPrefill, list[list[int]], list[int]]:
    """A runner whose bucket's buffers ran FIRST, then admitted SECOND (not yet prefilled)."""
    runner = _runner(ctx, dtype)
    graphs = GraphPrefill(runner.model, max_tokens=BUCKET.num_tokens, max_seqs=BUCKET.num_seqs,
                          use_graphs=graphs_on, capture_after=1)
    first = _prompts(ctx, FIRST, salt=0)
    ids = _admit(runner, first)
    runner.prefill(list(zip(ids, first, strict=True)), graphs)
    for sid in ids:
        runner.release(sid)
    second = _prompts(ctx, SECOND, salt=10)
    return runner, graphs, second, _admit(runner, second)


def _live_and_rest(runner: ModelRunner, ids: list[int], logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """The live sequences' logits, state slots and latent pages ("live.*"), and every other slot and page but the
    scratch ones ("rest.*")."""
    slots = [runner.slot_of(s) for s in ids]
    pages = sorted({p for s in ids for p in runner.kv_cache.table(s)})
    rest_slots = [i for i in range(runner.state_pool.num_slots + 1) if i not in slots and i != SCRATCH]
    rest_pages = [i for i in range(runner.kv_cache.data.shape[1]) if i not in pages and i != SCRATCH]
    out = {"live.logits": logits.clone(), "live.latents": runner.kv_cache.data[:, pages].clone(),
           "rest.latents": runner.kv_cache.data[:, rest_pages].clone()}
    for k, v in runner.state_pool.tensors().items():
        out[f"live.{k}"], out[f"rest.{k}"] = v[:, slots].clone(), v[:, rest_slots].clone()
    return out


@register_check(id="serving.prefill_graph.static_vs_eager", component="serving", level="serving",
                kind=Kind.BITEXACT, devices=("cpu",),
                control="the static step over the previous pack's offsets (a graph's baked capture lengths)")
def check_static_vs_eager(ctx: CheckContext) -> Trial:
    runner, graphs, second, ids = _two_packs(ctx, ctx.dtype, graphs_on=False)
    shape = graphs.shape_for(SECOND)
    if shape != BUCKET or graphs.static_runs != 1:
        raise RuntimeError(f"the first pack did not run the static step of bucket {BUCKET} (shape {shape}, "
                           f"{graphs.static_runs} static runs): the check would test nothing")
    before = _live_and_rest(runner, ids, torch.empty(0))
    inputs = graphs._static(BUCKET)
    stale_cu = inputs.cu_seqlens.clone()
    cand = _live_and_rest(runner, ids, runner.prefill(list(zip(ids, second, strict=True)), graphs))
    # the same buffers refilled with the second pack, its offsets replaced by the first pack's
    inputs.fill(graphs.staging, [t for p in second for t in p], list(SECOND), [runner.slot_of(s) for s in ids],
                [runner.kv_cache.table(s) for s in ids])
    inputs.cu_seqlens.copy_(stale_cu)
    with torch.no_grad():
        ctrl = _live_and_rest(runner, ids, static_prefill(runner.model, inputs)[:len(SECOND)])
    # eager, same slots and pages, the filler a real sequence (its own slot and pages): every GEMM has the same rows
    eager, _, again, eager_ids = _two_packs(ctx, ctx.dtype, graphs_on=False)
    if again != second or eager_ids != ids:
        raise RuntimeError("the eager runner admitted other prompts or ids than the static one")
    filler = [0] * (BUCKET.num_tokens - sum(SECOND))
    seqs = ids + _admit(eager, [filler])
    prompts = [*second, filler]
    batch = PackedBatch.build(torch.tensor([t for p in prompts for t in p]), [len(p) for p in prompts],
                              slots=[eager.slot_of(s) for s in seqs],
                              page_tables=[eager.kv_cache.table(s) for s in seqs],
                              page_size=PAGE, device=ctx.device)
    with torch.no_grad():
        out = eager.model.prefill(batch, capture=True)
        assert out.captures is not None
        # the lm_head over the static step's rows (the empty sequence's row is the filler's last token): same GEMM
        rows = torch.cat([batch.last_token_index, batch.last_token_index[-1:]])
        logits = eager.model.lm_head(out.captures["final_hidden"].index_select(0, rows))[:len(SECOND)]
    ref = _live_and_rest(eager, ids, logits)
    for key in ref:
        if key.startswith("rest."):  # elsewhere: nothing the static prefill may touch (the eager filler does)
            ref[key] = before[key]
    return Trial(reference=ref, candidate=cand, control=ctrl,
                 notes=[f"prompts {FIRST}, then {SECOND} through the same bucket {BUCKET} (a filler of "
                        f"{len(filler)} tokens and an empty sequence); the eager run admits the same packs in the same "
                        "order (same slots and pages) and prefills the filler as a real sequence of its own"])


@register_check(id="serving.prefill_graph.replay_vs_static", component="serving", level="serving",
                kind=Kind.BITEXACT, control="the graph replayed over the previous pack's buffers", devices=("cuda",))
def check_replay_vs_static(ctx: CheckContext) -> Trial:
    if ctx.device.type != "cuda":
        raise SkipCheck("CUDA graphs need a CUDA device")
    runner, graphs, second, ids = _two_packs(ctx, torch.bfloat16, graphs_on=True)
    if graphs.captures != 1 or graphs.replays != 1:
        raise RuntimeError(f"the first pack was not captured and replayed ({graphs.captures} captures, "
                           f"{graphs.replays} replays; eager buckets {graphs.eager_shapes})")
    cand = runner.prefill(list(zip(ids, second, strict=True)), graphs)
    static = GraphPrefill(runner.model, max_tokens=BUCKET.num_tokens, max_seqs=BUCKET.num_seqs, use_graphs=False)
    for sid in ids:
        runner.release(sid)
    ids = _admit(runner, second)
    ref = runner.prefill(list(zip(ids, second, strict=True)), static)
    for sid in ids:
        runner.release(sid)
    reversed_ = [p[::-1] for p in second]
    ids = _admit(runner, reversed_)
    runner.prefill(list(zip(ids, reversed_, strict=True)), graphs)  # the buffers now hold the reversed prompts
    ctrl = graphs.replay_stale(list(SECOND))
    if ctrl is None:
        raise RuntimeError("the bucket has no valid graph for the stale-buffer control")
    return Trial(reference=ref, candidate=cand, control=ctrl, metrics={"captures": float(graphs.captures)},
                 notes=[f"bucket {BUCKET}: captured over {FIRST}, replayed for {SECOND}"])
