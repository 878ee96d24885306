"""Speculative score on CUDA: the Triton kernels against the torch reference, the fused launch against the
unfused chain bit for bit (rows 1, 4, 8; eager and CUDA-graph replay), the captured score step against eager.
The kernel checks need CUDA (the CPU interpreter covers the kernels in tests/kernels/test_kernels_kda_score.py);
the captured step runs on CPU too, recorded by gates.shared.replay's rerun recorder (its static-buffer bookkeeping).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3verify.gates import CheckContext, Kind, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.replay import rerun_recorder
from k3verify.gates.shared.spec_cases import NUM_DRAFT, bits, op_case
from k3verify.gates.shared.spec_score import UNFUSED_OPS, fused_vs_unfused_trial, poisoned_records
from k3verify.kernels import kda as kda_ops
from k3verify.kernels.kda import score_launch
from k3verify.kernels.kda.score import SCORE_FUSED, kda_score
from k3verify.kernels.registry import REGISTRY, TRITON
from k3verify.serving.runner import ModelRunner
from k3verify.serving.spec.scorer import SpecScorer

ROWS = (1, 4, 8)


@register_check(
    id="spec.fused.vs_unfused", component="kernel", level="kernel", kind=Kind.BITEXACT, devices=("cuda",),
    control="the fused launch reads each row's state and windows from another row's slot",
)
def check_fused_vs_unfused(ctx: CheckContext) -> Trial:
    builders.require_fast_path("Triton KDA score kernels", score_launch.available())
    return fused_vs_unfused_trial(ctx, ROWS)


@register_check(
    id="spec.kernel.triton_vs_torch", component="kernel", level="kernel", kind=Kind.RMS, bar=2e-3,
    devices=("cuda",),
    bar_reason="bf16 outputs of fp32 values that differ by the kernels' exp / reduction order (~1e-7, as measured "
    "under the interpreter, where o and y matched bit for bit): at most one bf16 step (3.9e-3) on few elements; "
    "records one position late are O(1) off",
    control="records one position late (record j holds the state and windows before position j)",
)
def check_triton_vs_torch(ctx: CheckContext) -> Trial:
    builders.require_fast_path("Triton KDA score kernels", score_launch.available())
    case = op_case(ctx, torch.bfloat16, rows=4)
    with builders.torch_path(*UNFUSED_OPS):
        conv_rec, state_rec = poisoned_records(case)
        o, y = kda_score(case.xs, case.weights, case.windows, case.state, case.slots, case.keep, case.g,
                          case.beta, case.gate, case.norm_weight, case.eps, case.scale, conv_rec, state_rec,
                          fused=False)
        ref = {"o": o, "y": y, "conv_records": conv_rec, "state_records": state_rec}
    conv_rec, state_rec = poisoned_records(case)
    o, y = kda_score(case.xs, case.weights, case.windows, case.state, case.slots, case.keep, case.g, case.beta,
                      case.gate, case.norm_weight, case.eps, case.scale, conv_rec, state_rec, fused=False)
    builders.assert_routed(*UNFUSED_OPS, backend=TRITON)
    cand = {"o": o, "y": y, "conv_records": conv_rec, "state_records": state_rec}
    first_state = case.state.index_select(0, case.slots)[:, None]
    first_win = torch.stack([w.index_select(0, case.slots) for w in case.windows], dim=1)[:, None]
    ctrl = cand | {"state_records": torch.cat([first_state, state_rec[:, :-1]], 1),
                   "conv_records": torch.cat([first_win, conv_rec[:, :-1]], 1)}
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=[
        "4 rows x 5 positions, bf16, this preset's KDA dims: the three Triton ops vs their torch references"])


Bits = dict[str, torch.Tensor]


def _score_variants(ctx: CheckContext, fused: bool) -> tuple[Bits, Bits, Bits]:
    """Prefill three prompts once, then score one pack three ways from the same caches (restored from one
    snapshot, arena re-poisoned; nothing committed, so the runner's host-side counts never move): the static step
    eagerly (reference), the recorded step replayed over the capture's own scratch inputs (control: the refill
    skipped), the recorded step refilled and replayed (candidate). Each -> logits, records and the caches' bits
    right after the score. Recorded steps are CUDA graphs on CUDA; elsewhere the rerun recorder's stand-in,
    whose replays run the step again over the same static buffers."""
    cuda = ctx.device.type == "cuda"
    # CPU tests the bookkeeping, not bf16 kernels: the fp32 model and a short context keep it to seconds
    context = 256 if cuda else 64
    runner = ModelRunner(builders.serving_model(ctx, torch.bfloat16 if cuda else torch.float32), num_pages=40,
                         page_size=16, num_slots=4, max_context=context)
    prompts = [builders.prompt(ctx, n, salt=70 + i).tolist() for i, n in enumerate((9, 30, 17) if cuda else (5, 12, 7))]
    for sid, p in enumerate(prompts):
        runner.admit(sid, len(p) + NUM_DRAFT + 1)
    with builders.torch_path(kda_ops.PREFILL):  # fla's chunk kernels would autotune on a cold GPU: not what is tested
        runner.prefill(list(enumerate(prompts)))
    B, n = len(prompts), NUM_DRAFT + 1
    flat = [t for sid in range(B) for t in builders.prompt(ctx, n, salt=80 + sid).tolist()]
    slots, tables = [runner.slot_of(s) for s in range(B)], [runner.kv_cache.table(s) for s in range(B)]
    starts = [runner.num_cached(s) for s in range(B)]
    scorer = SpecScorer(runner, NUM_DRAFT, 4, fused=fused)
    pool = runner.state_pool.tensors()
    snap = ({k: v.clone() for k, v in pool.items()}, runner.kv_cache.data.clone())

    def bits_after(step: Callable[[], torch.Tensor]) -> Bits:
        for k, v in snap[0].items():
            pool[k].copy_(v)
        runner.kv_cache.data.copy_(snap[1])
        scorer.arena.poison()
        logits = step()
        if cuda:
            torch.cuda.synchronize()
        arena = scorer.arena
        return {"logits": bits(logits.float()), "state_records": bits(arena.state[:, :B]),
                "conv_records": bits(arena.conv[:, :B]), "latents": bits(runner.kv_cache.data),
                "pool": bits(runner.state_pool.state)}

    eager = scorer.make_graphs(context, (4,), use_graphs=False)
    graphs = scorer.make_graphs(context, (4,), recorder=None if cuda else rerun_recorder)
    ref = bits_after(lambda: eager.score(flat, slots, tables, starts)[0])
    ctrl = bits_after(lambda: graphs.replay_stale(B))  # captures first: its static inputs hold scratch rows
    cand = bits_after(lambda: graphs.score(flat, slots, tables, starts)[0])
    return ref, cand, ctrl


@register_check(
    id="spec.verify.graph_vs_eager", component="serving", level="serving", kind=Kind.BITEXACT,
    control="the captured score replayed over the capture's own (scratch) inputs instead of this step's rows",
)
def check_score_graph_vs_eager(ctx: CheckContext) -> Trial:
    ref: Bits = {}
    cand: Bits = {}
    ctrl: Bits = {}
    # off CUDA a fused request runs the unfused reference (kda.score_fused's torch backend): one path to test
    for fused in (False, True) if ctx.device.type == "cuda" else (False,):
        path = "fused" if fused else "unfused"
        for out, bits_ in zip((ref, cand, ctrl), _score_variants(ctx, fused), strict=True):
            out.update({f"{path}.{key}": value for key, value in bits_.items()})
    cuda = ctx.device.type == "cuda"
    how = "a CUDA graph" if cuda else "the rerun recorder (static-buffer bookkeeping only)"
    setup = "bf16 model, context 256, prompts (9, 30, 17)" if cuda else "fp32 model, context 64, prompts (5, 12, 7)"
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=[
        f"{setup}, one score pack of {NUM_DRAFT + 1} tokens in a bucket of 4 rows from one prefill (caches "
        f"restored between runs); the same static step eager vs replayed from {how}; KDA score paths "
        f"{sorted({k.split('.')[0] for k in ref})}, last fused path taken: "
        f"{REGISTRY.last_backend.get(SCORE_FUSED, 'none')}"])
