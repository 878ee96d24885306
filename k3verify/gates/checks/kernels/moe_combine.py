"""The CUDA routed-expert combine vs the torch loop it replaces, through the kernel registry (CUDA only).

On CUDA `moe.combine` runs the decode kernels (bf16, at most decode_launch.MAX_PAIRS (token, expert) pairs),
two grouped GEMMs over the stacked experts (larger bf16 steps) or a per-pair weight gather with batched GEMVs
(fp32): static shapes, no host sync, so a decode step that contains it can be captured in a CUDA graph. The
module checks (`moe.module.*`) compare our MoE with the reference bit for bit in fp32, which these paths match
only to rounding, so those pin the torch loop and these checks hold the fast paths to it: every MoE layer of
the preset, the preset's own routing of random inputs, the same (weights, ids) for both sides; for layers whose shared
expert joins the combine (neither latent nor packed), also the combine with the shared expert's output added.
Control: every (token, slot) routed to the next expert id (the combine's expert offsets off by one).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.kernels.moe import COMBINE, decode_launch, grouped, moe_combine
from k3verify.kernels.moe import torch_ref as moe_ref
from k3verify.kernels.registry import CUDA

TOKENS = 48  # decode-to-small-prefill sized: a few rows per expert, some experts hit by none


def combine_trial(ctx: CheckContext, dtype: torch.dtype, tokens: tuple[int, ...] = (TOKENS,),
                  path: str | None = None) -> Trial:
    """Every MoE layer at each of `tokens`; `path` pins the bf16 combine to "decode" or "grouped" and the check
    refuses to pass unless that path ran."""
    cfg = ctx.cfg
    layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    if not layers:
        raise SkipCheck("the preset has no MoE layer")
    builders.require_fast_path("CUDA MoE combine", grouped.available())
    model = builders.serving_model(ctx, dtype)
    ref: dict[str, torch.Tensor] = {}
    cand: dict[str, torch.Tensor] = {}
    ctrl: dict[str, torch.Tensor] = {}
    for i, n in itertools.product(layers, tokens):
        moe: Any = builders.layers(model)[i].ffn_module
        x = builders.layer_inputs(ctx, n, dtype)
        with torch.no_grad(), grouped.forced_path(path) if path else contextlib.nullcontext():
            weights, idx = moe.gate(x)
            x_in = moe.routed_expert_down_proj(x) if moe.latent else x
            key = f"layers.{i}.tokens{n}"
            ran = grouped.PATHS[path] if path else 0
            cand[key] = moe_combine(moe, x_in, weights, idx)
            builders.assert_routed(COMBINE, backend=CUDA)
            if path and grouped.PATHS[path] != ran + 1:
                raise RuntimeError(f"the combine did not run the {path} kernels (paths so far {dict(grouped.PATHS)})")
            ref[key] = moe_ref.combine_loop(moe, x_in, weights, idx)
            ctrl[key] = moe_combine(moe, x_in, weights, (idx + 1) % len(moe.experts))
            if not (moe.latent or moe.is_packed):  # the layer's call: the shared expert added in the combine
                shared = moe.shared_experts(x)
                cand[f"{key}.shared_added"] = moe_combine(moe, x_in, weights, idx, add=shared).float()
                ref[f"{key}.shared_added"] = moe_ref.combine_loop(moe, x_in, weights, idx, add=shared).float()
                ctrl[f"{key}.shared_added"] = moe_combine(moe, x_in, weights, (idx + 1) % len(moe.experts),
                                                          add=shared).float()
    return Trial(reference=ref, candidate=cand, control=ctrl,
                 notes=[f"{len(layers)} MoE layer(s), {', '.join(map(str, tokens))} tokens, {dtype}, "
                        f"routing of the preset's gate" + (f", the {path} kernels" if path else "")])


@register_check(
    id="kernel.moe.grouped_vs_torch", component="kernel", level="kernel", kind=Kind.RMS, devices=("cuda",),
    bar=1e-2, bar_reason="bf16 experts: both sides accumulate in fp32 and round each GEMM output to bf16, so a "
    "different accumulation order flips at most one rounding (2^-8 = 3.9e-3 relative) per element of the gate/up "
    "and of the down output: <= ~6e-3 RMS even if every element flipped (on CPU torch._grouped_mm equals the "
    "loop: 0; on CUDA the distance stays orders of magnitude below the bar); a wrong expert offset moves the "
    "output by ~1.3",
    control="every (token, slot) routed to the next expert id",
)
def check_moe_grouped(ctx: CheckContext) -> Trial:
    return combine_trial(ctx, torch.bfloat16, path="grouped")


@register_check(
    id="kernel.moe.decode_vs_torch", component="kernel", level="kernel", kind=Kind.RMS, devices=("cuda",),
    bar=1e-2, bar_reason="bf16 experts, the decode kernels (kernels/moe/decode_kernel.py): like the grouped GEMMs "
    "they accumulate in fp32 and round each GEMM output to bf16 where the loop's F.linear does, so only the "
    "accumulation order differs: at most one bf16 rounding flip (3.9e-3 relative) per element of the GLU input and "
    "of the down output, <= ~6e-3 RMS if every element flipped (0 under the Triton interpreter, whose dots are "
    "exact fp32 sums); a wrong expert offset moves the output by ~1.3",
    control="every (token, slot) routed to the next expert id",
)
def check_moe_decode(ctx: CheckContext) -> Trial:
    top_k = ctx.cfg.num_experts_per_token
    return combine_trial(ctx, torch.bfloat16, tokens=(1, 4, max(1, decode_launch.MAX_PAIRS // top_k)), path="decode")


@register_check(
    id="kernel.moe.gathered_vs_torch", component="kernel", level="kernel", kind=Kind.RMS, devices=("cuda",),
    bar=1e-5, bar_reason="fp32 experts: the per-pair gather's batched GEMVs and the loop's GEMMs sum the same "
    "fp32 products in other orders and add each token's k terms in route order, not expert order (fp32 unit "
    "roundoff 6e-8 times the reduction depth's square root; 1.8e-7 to 2.3e-7 on CPU for k3-tiny, kl-tiny and "
    "k3-syn-25, the same order on CUDA); a wrong expert offset moves the output by ~1.3",
    control="every (token, slot) routed to the next expert id",
)
def check_moe_gathered(ctx: CheckContext) -> Trial:
    # The gather's memory grows with the pairs and past its budget the combine runs the torch loop, which this
    # check must not compare with itself: at real width (kl-48b-8l: 37 pairs) it takes fewer tokens than TOKENS.
    model = builders.serving_model(ctx, torch.float32)
    moe: Any = next(layer.ffn_module for layer in builders.layers(model) if layer.is_moe)
    fit = grouped.gather_max_pairs(moe, ctx.cfg.expert_in_dim, 4) // ctx.cfg.num_experts_per_token
    if fit < 1:
        raise SkipCheck(f"one token's {ctx.cfg.num_experts_per_token} (token, expert) pairs are more than the fp32 "
                        "gather path takes; every batch runs the torch loop")
    trial = combine_trial(ctx, torch.float32, tokens=(min(TOKENS, fit),))
    if fit < TOKENS:
        trial.notes.append(f"{fit} tokens: the most whose pairs the fp32 gather takes at this width "
                           f"({grouped.GATHER_BUDGET_BYTES / 2**30:.0f} GiB of gathered weights)")
    return trial
