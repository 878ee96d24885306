"""Packed (varlen) prefill keeps sequences apart: packed vs per-sequence, the conv boundary, segment
ids, segmented KDA, FFN tiling and the preallocated block-residual buffer.

Bit-exactness needs identical GEMM/elementwise shapes per row: sequences of 64 tokens (a multiple of
the CPU vector width and past the small-M GEMM kernels) give that for every row-wise op, so the
attention/KDA/conv channels are compared bit for bit there. On CUDA, cuBLAS picks its algorithm (and
split-K) by M, so a row's bits depend on how many rows share the GEMM: the checks that rest on
row-invariant GEMMs (equal-length packing through layer 0, FFN tiling) are CPU-only (on CUDA most layer-0 FFN
elements differ by an ulp), and unequal-length packing covers CUDA. MoE
expert groups change with packing, so a whole model is bit-exact only through layer 0; unequal lengths
are compared with a measured bar.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.core.compare import rel_rms_error
from k3verify.gates.shared import builders
from k3verify.gates.shared.patch import patched
from k3verify.gates.shared.route_pin import PinStats, pin_routes, record_routes
from k3verify.serving.batch import PackedBatch, segment_ids
from k3verify.serving.layers import kda as kda_mod
from k3verify.serving.layers import mla as mla_mod
from k3verify.serving.layers import mlp as mlp_mod
from k3verify.serving.layers.attn_res import BlockBuffer, num_blocks
from k3verify.serving.model import ForwardOutput, ServingModel

EQUAL = [64, 64, 64]
UNEQUAL = [37, 64, 5, 90]


def plain_triangle(batch: PackedBatch, key_cu: list[int]) -> list[tuple[int, int, int]]:
    """The fault: query t of sequence i sees every earlier key of the pack (a plain causal triangle)."""
    return [(0, key_cu[i + 1], key_cu[i] + batch.start_list[i]) for i in range(batch.num_seqs)]


def _run(model: ServingModel, ids: torch.Tensor, lens: list[int], device: torch.device) -> ForwardOutput:
    return model.prefill(PackedBatch.build(ids, lens, device=device), all_logits=True, capture=True)


def _per_sequence(model: ServingModel, ids: torch.Tensor, lens: list[int], device: torch.device) -> list[ForwardOutput]:
    outs, start = [], 0
    for n in lens:
        outs.append(_run(model, ids[start:start + n], [n], device))
        start += n
    return outs


def _depth(ref: ForwardOutput, cand: ForwardOutput) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Captures in depth order (attn_out, ffn_out per layer, final_hidden) for localization."""
    assert ref.captures is not None and cand.captures is not None
    names = sorted((k for k in ref.captures if k != "final_hidden"),
                   key=lambda k: (int(k.split(".")[1]), k.endswith("ffn_out")))
    return [(k, ref.captures[k], cand.captures[k]) for k in names + ["final_hidden"]]


def _captures(out: ForwardOutput) -> dict[str, torch.Tensor]:
    if out.captures is None:
        raise RuntimeError("the pass ran without capture=True: it has no layer captures to compare")
    return out.captures


def _output(out: ForwardOutput, key: str) -> torch.Tensor:
    """A pass's logits ("logits") or one of its captures."""
    if key != "logits":
        return _captures(out)[key]
    if out.all_logits is None:
        raise RuntimeError("the pass ran without all_logits=True: it has no per-token logits to compare")
    return out.all_logits


def _cat(outs: list[ForwardOutput], key: str) -> torch.Tensor:
    return torch.cat([_output(o, key) for o in outs])


@register_check(
    id="serving.packed.equal_lengths", component="serving", level="serving", kind=Kind.BITEXACT, devices=("cpu",),
    control="plain triangular causal mask over the whole pack (sequence 2 attends to sequence 1)",
)
@builders.single_thread
def check_packed_equal(ctx: CheckContext) -> Trial:
    model, T = builders.served_model(ctx), sum(EQUAL)
    ids = builders.prompt(ctx, T, salt=1)
    singles = _per_sequence(model, ids, EQUAL, ctx.device)
    packed = _run(model, ids, EQUAL, ctx.device)
    with patched(mla_mod, "key_ranges", plain_triangle):
        wrong = _run(model, ids, EQUAL, ctx.device)
    keys = ["layers.0.attn_out", "layers.0.ffn_out"]
    ref = {k: _cat(singles, k) for k in keys}
    cand = {k: _output(packed, k) for k in keys}
    ctrl = {k: _output(wrong, k) for k in keys}
    x = builders.layer_inputs(ctx, T, model.dtype)
    for i in ctx.cfg.full_attn_layers:
        attn = builders.layers(model)[i].self_attn
        key = f"mla.layers.{i}"
        ref[key] = torch.cat([attn(x[a:a + n], builders.single_pass(builders.dummy_ids(n), ctx.device))
                              for a, n in zip(range(0, T, EQUAL[0]), EQUAL, strict=True)])
        cand[key] = attn(x, builders.packed_pass(EQUAL, ctx.device))
        with patched(mla_mod, "key_ranges", plain_triangle):
            ctrl[key] = attn(x, builders.packed_pass(EQUAL, ctx.device))
    return Trial(reference=ref, candidate=cand, control=ctrl, position_dim=0, notes=[
        f"{len(EQUAL)} sequences x {EQUAL[0]} tokens; model layer 0 (KDA + dense MLP) and every MLA layer as a "
        "module are bit-exact packed vs alone; deeper model layers are not comparable bit for bit because MoE "
        "expert groups (GEMM M) change with packing (serving.packed.unequal_lengths covers the whole model)"])


@register_check(
    id="serving.packed.unequal_lengths", component="serving", level="serving", kind=Kind.RMS,
    noise="the K3 reference's logits in fp32 vs fp64 (routes pinned) on each sequence alone",
    control="plain triangular causal mask over the whole pack (sequence 2 attends to sequence 1)",
)
@builders.single_thread
def check_packed_unequal(ctx: CheckContext) -> Trial:
    model = builders.serving_model(ctx)
    ids = builders.prompt(ctx, sum(UNEQUAL), salt=2)
    with record_routes(model) as routes:
        singles = _per_sequence(model, ids, UNEQUAL, ctx.device)
    stats = PinStats()
    with pin_routes(model, routes, model, ctx.cfg, stats):
        packed = _run(model, ids, UNEQUAL, ctx.device)
    with pin_routes(model, routes, model, ctx.cfg, PinStats()), patched(mla_mod, "key_ranges", plain_triangle):
        wrong = _run(model, ids, UNEQUAL, ctx.device)
    ref, cand, ctrl = _cat(singles, "logits"), _output(packed, "logits"), _output(wrong, "logits")
    cand_err, ctrl_err = rel_rms_error(ref, cand), rel_rms_error(ref, ctrl)
    noise = None
    if ctx.needs_noise:
        seqs = ids.split(UNEQUAL)
        noise = (torch.cat([builders.reference_forward(ctx, s)[0].logits for s in seqs]),
                 torch.cat([builders.reference_gold(ctx, s).logits for s in seqs]))
    names = [name for name, _, _ in _depth(packed, packed)]
    layers = [(k, _cat(singles, k), _output(packed, k)) for k in names]
    metrics = {"candidate_rel_rms": cand_err, "control_rel_rms": ctrl_err,
               "control_over_candidate": ctrl_err / cand_err if cand_err > 0 else float("inf"), **stats.as_metrics()}
    return Trial(reference=ref, candidate=cand, control=ctrl, position_dim=0, layers=layers, metrics=metrics,
                 noise=noise, notes=[
        f"lengths {UNEQUAL}; attainable {cand_err:.3g}; the plain-triangle control sits at {ctrl_err:.3g}",
        f"router: {stats.pinned} of {stats.flips} flipped token choices pinned as drift-explained near-ties"])


def same_row_count_reference(ctx: CheckContext) -> bool:
    """Whether "alone" keeps the pack's row count (CUDA) instead of running each sequence by itself (CPU)."""
    return ctx.device.type == "cuda"


def _kda_packed_trial(ctx: CheckContext, wrong_meta: dict[str, Any], what: str) -> Trial:
    if not ctx.cfg.has_kda:
        raise SkipCheck("preset has no KDA layers")
    model, T = builders.serving_model(ctx), sum(EQUAL)
    x = builders.layer_inputs(ctx, T, torch.float32)
    good = builders.packed_pass(EQUAL, ctx.device)
    bad = builders.packed_pass(EQUAL, ctx.device)
    bad.batch = dataclasses.replace(bad.batch, **wrong_meta)
    spans = list(zip(range(0, T, EQUAL[0]), EQUAL, strict=True))
    # On CUDA a row's GEMM bits depend on the row count (module docstring): there "alone" is the same pack with
    # every other sequence's inputs replaced by other values, so the GEMMs keep their shape and a sequence that
    # sees its neighbours (a leak) sees different ones than in the real pack.
    same_rows = same_row_count_reference(ctx)
    others = -x.flip(0)
    ref, cand, ctrl = {}, {}, {}
    for i in ctx.cfg.kda_layers:
        attn = builders.layers(model)[i].self_attn
        key = f"layers.{i}"
        if same_rows:
            rows = []
            for a, n in spans:
                alone = others.clone()
                alone[a:a + n] = x[a:a + n]
                rows.append(attn(alone, good)[a:a + n])
            ref[key] = torch.cat(rows)
        else:
            ref[key] = torch.cat([attn(x[a:a + n], builders.single_pass(builders.dummy_ids(n), ctx.device))
                                  for a, n in spans])
        cand[key] = attn(x, good)
        ctrl[key] = attn(x, bad)
    alone_is = ("the same pack with the other sequences' inputs replaced (CUDA: GEMM bits depend on the row count)"
                if same_rows else "each sequence run alone")
    return Trial(reference=ref, candidate=cand, control=ctrl, position_dim=0,
                 notes=[f"every KDA layer, {len(EQUAL)} sequences x {EQUAL[0]} tokens packed vs {alone_is}; "
                        f"control: {what}"])


@register_check(
    id="kda.conv.packed_boundary", component="kda", level="module", kind=Kind.BITEXACT,
    control="conv windows leak across sequences (the pack convolved as one sequence)",
)
@builders.single_thread
def check_conv_boundary(ctx: CheckContext) -> Trial:
    T = sum(EQUAL)
    leak = {"seg_ids": torch.zeros(T, dtype=torch.long, device=ctx.device),
            "local_pos": torch.arange(T, device=ctx.device),
            "cu_seqlens": torch.tensor([0, T], device=ctx.device)}
    return _kda_packed_trial(ctx, leak, "conv sees the previous sequence's last W-1 inputs")


@register_check(
    id="serving.packed.segment_ids", component="serving", level="serving", kind=Kind.BITEXACT,
    control="segment ids from bucketize(right=False): every first token assigned to the previous sequence",
)
@builders.single_thread
def check_segment_ids(ctx: CheckContext) -> Trial:
    T = sum(EQUAL)
    cu = torch.tensor([0, 64, 128, 192], device=ctx.device)
    wrong_seg = torch.bucketize(torch.arange(T, device=ctx.device), cu, right=False) - 1
    wrong = {"seg_ids": wrong_seg, "local_pos": torch.arange(T, device=ctx.device) - cu[wrong_seg]}
    trial = _kda_packed_trial(ctx, wrong, "bucketize(right=False) segment ids")
    expected = torch.cat([torch.full((n,), i) for i, n in enumerate(EQUAL)]).to(ctx.device)
    trial.reference["seg_ids"] = expected
    trial.candidate["seg_ids"] = segment_ids(cu, T)
    trial.control["seg_ids"] = wrong_seg
    return trial


@register_check(
    id="kda.segmented", component="kda", level="model", kind=Kind.BITEXACT,
    control="a KDA segment cut mid-chunk (32 tokens off the 64 grid) forced past the cut check",
)
@builders.single_thread
def check_segmented(ctx: CheckContext) -> Trial:
    if not ctx.cfg.has_kda:
        raise SkipCheck("preset has no KDA layers")
    model, lens = builders.serving_model(ctx), [150, 64, 200]
    ids = builders.prompt(ctx, sum(lens), salt=3)
    batch = PackedBatch.build(ids, lens, device=ctx.device)
    whole = model.prefill(batch, all_logits=True, capture=True)
    seg = model.prefill(batch, all_logits=True, capture=True, segment_len=64)
    if not seg.stats or seg.stats.get("kda_segmented", 0) == 0:
        raise RuntimeError("segment_len=64 did not engage segmented KDA")

    def mid_chunk(seq_lens: list[int], segment_len: int | None) -> list[list[tuple[int, int]]]:
        return [[(0, 96), (96, n)] if n > 96 else [(0, n)] for n in seq_lens]
    with patched(kda_mod, "segment_pieces", mid_chunk), patched(kda_mod, "check_pieces", lambda *a: None):
        wrong = model.prefill(batch, all_logits=True, capture=True, segment_len=64)
    keys = ["logits"] + [k for k in _captures(whole) if ".attn_out" in k]
    return Trial(reference={k: _output(whole, k) for k in keys}, candidate={k: _output(seg, k) for k in keys},
                 control={k: _output(wrong, k) for k in keys}, layers=_depth(whole, seg),
                 control_layers=_depth(whole, wrong), notes=[
                     f"lengths {lens}, segment_len 64 (fp32 state handed across segments) vs one pass; "
                     f"segmented layer passes: {seg.stats.get('kda_segmented', 0)}"])


@register_check(
    id="mlp.tiled", component="mlp", level="module", kind=Kind.BITEXACT, devices=("cpu",),
    control="a ragged tiling that drops the last 3 rows",
)
@builders.single_thread
def check_tiled_ffn(ctx: CheckContext) -> Trial:
    # T=193 leaves a 1-row remainder that must merge into the last tile (a lone 1-row GEMM takes the
    # GEMV path and rounds differently); T=210 leaves a 17-row last tile that stands on its own, so a
    # tiling that drops its last row cannot hide behind the merge.
    model = builders.serving_model(ctx)
    mlps = {}
    for i, layer in enumerate(builders.layers(model)):
        mlps[f"layers.{i}." + ("shared_experts" if layer.is_moe else "mlp")] = (
            layer.block_sparse_moe.shared_experts if layer.is_moe else layer.mlp)
    tiles = mlp_mod.even_tiles

    def ragged(total: int, max_rows: int) -> list[tuple[int, int]]:
        return [(a, min(b, total - 3)) for a, b in tiles(total, max_rows)]
    ref, cand, ctrl = {}, {}, {}
    for T in (193, 210):
        x = builders.layer_inputs(ctx, T, torch.float32)
        for key, mlp in mlps.items():
            ref[f"T{T}.{key}"] = mlp(x)
            with patched(mlp, "tile_tokens", 48):
                cand[f"T{T}.{key}"] = mlp(x)
                with patched(mlp_mod, "even_tiles", ragged):
                    ctrl[f"T{T}.{key}"] = mlp(x)
    return Trial(reference=ref, candidate=cand, control=ctrl,
                 notes=[f"T={T} in tiles of <=48 rows: {tiles(T, 48)}" for T in (193, 210)])


@register_check(
    id="attn_res.prealloc", component="attn_res", level="model", kind=Kind.BITEXACT,
    control="the whole preallocated buffer handed to the mix (unused columns join the softmax)",
)
@builders.single_thread
def check_attn_res_prealloc(ctx: CheckContext) -> Trial:
    if not ctx.cfg.uses_attn_res:
        raise SkipCheck("preset has no Block Attention Residuals")
    model = builders.serving_model(ctx)
    ids = builders.prompt(ctx, 40, salt=4)
    batch = PackedBatch.build(ids, [17, 23], device=ctx.device)
    pre = model.prefill(batch, all_logits=True, capture=True)
    if not pre.stats or pre.stats.get("attn_res_prealloc", 0) == 0:
        raise RuntimeError("the preallocated block buffer was not engaged")
    with patched(model, "attn_res_storage", "concat"):
        cat = model.prefill(batch, all_logits=True, capture=True)
    with patched(BlockBuffer, "view", lambda self: self.data):
        wrong = model.prefill(batch, all_logits=True, capture=True)
    out = {}
    for name, o in (("ref", cat), ("cand", pre), ("ctrl", wrong)):
        out[name] = {"logits": _output(o, "logits"), **_captures(o)}
    return Trial(reference=out["ref"], candidate=out["cand"], control=out["ctrl"], layers=_depth(cat, pre),
                 control_layers=_depth(cat, wrong),
                 notes=["reference: block entries restacked by concatenation at every read; candidate: one "
                        f"preallocated [tokens, {num_blocks(model.cfg)}, H] buffer per pass, narrowed to the "
                        "filled entries; engaged in "
                        f"{pre.stats.get('attn_res_prealloc', 0)} pass(es)"])
