"""Router, MoE / LatentMoE and MXFP4 expert-weight faults."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

MOE = "k3verify.serving.layers.moe"
ROUTER = "k3verify.kernels.router.torch_ref"  # Router.forward's math after the fp32 linear
MXFP4_KERNEL = "k3verify.kernels.mxfp4.torch_ref"

MUTANTS = [
    Mutant(
        id="router.correction_bias_ignored", quick=True,
        fault="experts are chosen by top-k of the plain sigmoid scores, without e_score_correction_bias",
        target=f"{ROUTER}:route_torch",
        old="choice = scores + bias",
        new="choice = scores",
        killers=["router.*", "moe.*"],
    ),
    Mutant(
        id="router.bias_in_weights", quick=True,
        fault="the combine weights are the bias-corrected scores instead of the uncorrected sigmoid scores",
        target=f"{ROUTER}:route_torch",
        old="weights = scores.gather(1, idx)",
        new="weights = choice.gather(1, idx)",
        killers=["router.*", "moe.*"],
    ),
    Mutant(
        id="router.no_renormalize",
        fault="the top-k weights are not renormalized to sum to one",
        target=f"{ROUTER}:route_torch",
        old="if renormalize and top_k > 1:",
        new="if False:",
        killers=["router.*", "moe.*"],
    ),
    Mutant(
        id="router.no_scaling_factor",
        fault="routed_scaling_factor is never applied to the routing weights",
        target=f"{ROUTER}:route_torch",
        old="return weights * scaling, idx",
        new="return weights, idx",
        killers=["router.*", "moe.*"],
    ),
    Mutant(
        id="router.softmax_scores",
        fault="router scores use softmax over experts instead of sigmoid",
        target=f"{ROUTER}:route_torch",
        old="scores = torch.sigmoid(logits)",
        new="scores = torch.softmax(logits, dim=-1)",
        killers=["router.*", "moe.*"],
    ),
    Mutant(
        id="router.grouped_topk_ignored",
        fault="grouped top-k (num_expert_group > topk_group) is skipped: experts come from every group",
        target=f"{ROUTER}:route_torch",
        old="if groups > topk_group:",
        new="if False:",
        killers=["router.*", "moe.*"], presets=("k3-skew-10",),
    ),
    Mutant(
        id="moe.combine_in_bf16", quick=True,
        fault="the expert outputs are accumulated in the activation dtype (bf16) instead of fp32",
        target=f"{MOE}:SparseMoE.combine",
        old="out.index_add_(0, rows, ye.float() * w_sorted[start:start + count, None])",
        new="out = out.index_add(0, rows, ye.float() * w_sorted[start:start + count, None]).to(x_in.dtype).float()",
        killers=["moe.*"],
    ),
    Mutant(
        id="moe.gate_up_swapped",
        fault="the routed experts use w3 as the gate and w1 as the up projection",
        target=f"{MOE}:SparseMoE.combine",
        old="ye = F.linear(self.act(F.linear(xe, w1), F.linear(xe, w3)), w2)",
        new="ye = F.linear(self.act(F.linear(xe, w3), F.linear(xe, w1)), w2)",
        killers=["moe.*"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="moe.latent_norm_per_expert", quick=True,
        fault="routed_expert_norm is applied to each expert's output before the combine instead of once after it",
        target=f"{MOE}:SparseMoE.combine",
        old="ye = F.linear(self.act(F.linear(xe, w1), F.linear(xe, w3)), w2)",
        new="ye = F.linear(self.act(F.linear(xe, w1), F.linear(xe, w3)), w2)\n"
            "            ye = self.routed_expert_norm(ye) if hasattr(self, 'routed_expert_norm') else ye",
        also=(("                y = self.routed_expert_norm(y)\n", "                pass\n"),),
        killers=["moe.*"],
    ),
    Mutant(
        id="moe.latent_norm_after_up_proj",
        fault="the LatentMoE norm runs in hidden space after routed_expert_up_proj instead of in the latent before it",
        target=f"{MOE}:SparseMoE.forward",
        old="                y = self.routed_expert_norm(y)\n            y = self.routed_expert_up_proj(y)",
        new="                pass\n            y = self.routed_expert_up_proj(y)\n"
            "            y = F.rms_norm(y.float(), (y.shape[-1],), eps=self.routed_expert_norm.eps).to(y.dtype)",
        killers=["moe.*"],
    ),
    Mutant(
        id="moe.shared_expert_dropped",
        fault="the shared expert output is not added to the routed output",
        target=f"{MOE}:SparseMoE.forward",
        old="return y + self.shared_experts(x)",
        new="return y",
        # plain (unpacked) MoE adds the shared expert inside the combine's last launch, not on the line above
        also=(("return moe_combine(self, x, weights, idx, add=self.shared_experts(x))",
               "return moe_combine(self, x, weights, idx).to(x.dtype)"),),
        killers=["moe.*"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="mxfp4.kernel.high_nibble_first", quick=True,
        fault="the serving MXFP4 decoder reads the high nibble of each byte as the earlier element",
        target=f"{MXFP4_KERNEL}:codes_low_first",
        old="return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)",
        new="return torch.stack((packed >> 4, packed & 0x0F), dim=-1).flatten(-2)",
        killers=["moe.*", "kernel.mxfp4*"],
    ),
    Mutant(
        id="mxfp4.kernel.e8m0_bias_128",
        fault="the serving MXFP4 decoder uses an E8M0 bias of 128 (every weight halved)",
        target=f"{MXFP4_KERNEL}:dequantize_torch",
        old="scale.to(torch.int32) - 127",
        new="scale.to(torch.int32) - 128",
        killers=["moe.*", "kernel.mxfp4*"],
    ),
    Mutant(
        id="moe.packed_up_rows_first",
        fault="the packed experts stack w3 (up) rows before w1 (gate) rows: gate and up swapped in the GLU",
        target=f"{MOE}:SparseMoE.packed_experts",
        old='_stack([[_packed_weight(ex, "w1"), _packed_weight(ex, "w3")] for ex in self.experts])',
        new='_stack([[_packed_weight(ex, "w3"), _packed_weight(ex, "w1")] for ex in self.experts])',
        killers=["moe.module.packed"], presets=("k3-tiny", "k3-skew-10"),
    ),
    Mutant(
        id="mxfp4.grouped_previous_expert",
        fault="the packed grouped GEMM's torch path multiplies each expert's rows by the previous expert's weights",
        target=f"{MXFP4_KERNEL}:grouped_mm_torch",
        old="w = dequantize_torch(codes[e], scales[e], x.dtype, group)",
        new="w = dequantize_torch(codes[max(e - 1, 0)], scales[max(e - 1, 0)], x.dtype, group)",
        killers=["moe.module.packed"], presets=("k3-tiny", "k3-skew-10"),
    ),
]
