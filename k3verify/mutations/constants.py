"""Config-dependent constants and the precision of fp32-inside-bf16 reductions: one norm site at the wrong eps,
a reduction done in bf16 where the reference does it in fp32 (the `*_in_activation_dtype` entries change the
accumulator's dtype alone: a sequential fp32 accumulator in their place passes norm.sites.bf16), a constant read
from the wrong config key.

Faults of this kind move whole-model fp32 logits by less than a model-level bar; they are killed by the
module-level checks built for them (norm.sites.*, mlp.act.*, attn_res.module.*, mla.decode.bf16)."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

DEC = "k3verify.serving.layers.decoder"
MODEL = "k3verify.serving.model"
MLA = "k3verify.serving.layers.mla"
RES = "k3verify.serving.layers.attn_res"
NORMS = ["norm.sites.*"]
# mean(x32^2) with the running sum rounded to x's dtype after every add (fp32 squares, fp32 adds, bf16 storage)
MEAN_SQUARE_IN_X_DTYPE = ("__import__('functools').reduce(lambda a, b: (a + b).to(x.dtype), x32.pow(2).unbind(-1), "
                          "torch.zeros((), dtype=x.dtype)).float()[..., None] / x32.shape[-1]")

MUTANTS = [
    Mutant(
        id="norm.eps.final_norm", quick=True,
        fault="the final norm uses eps 1e-6 instead of rms_norm_eps",
        target=f"{MODEL}:KimiModel.__init__",
        old="self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype)", new="self.norm = RMSNorm(H, 1e-6, dtype)",
        killers=NORMS, presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="norm.eps.input_layernorm",
        fault="every input_layernorm uses eps 1e-6 instead of rms_norm_eps",
        target=f"{DEC}:DecoderLayer.__init__",
        old="self.input_layernorm = RMSNorm(H, eps, dtype)", new="self.input_layernorm = RMSNorm(H, 1e-6, dtype)",
        killers=NORMS,
    ),
    Mutant(
        id="norm.eps.post_attention_layernorm_default",
        fault="every post_attention_layernorm hard-codes the usual eps 1e-5 instead of reading rms_norm_eps (2e-5 "
              "on k3-skew-10)",
        target=f"{DEC}:DecoderLayer.__init__",
        old="self.post_attention_layernorm = RMSNorm(H, eps, dtype)",
        new="self.post_attention_layernorm = RMSNorm(H, 1e-5, dtype)",
        killers=NORMS, presets=("k3-skew-10",),
    ),
    Mutant(
        id="norm.eps.q_a_layernorm",
        fault="the MLA q_a_layernorm uses rms_norm_eps instead of its fixed 1e-6 (kv_a_layernorm stays right)",
        target=f"{MLA}:MultiHeadLatentAttention.__init__",
        old="self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS, dtype)",
        new="self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)",
        killers=NORMS,
    ),
    Mutant(
        id="norm.eps.kv_a_layernorm",
        fault="the MLA kv_a_layernorm uses rms_norm_eps instead of its fixed 1e-6 (q_a_layernorm stays right)",
        target=f"{MLA}:MultiHeadLatentAttention.__init__",
        old="self.kv_a_layernorm = RMSNorm(self.rank, LORA_NORM_EPS, dtype)",
        new="self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps, dtype)",
        killers=NORMS, presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="norm.eps.kda_o_norm",
        fault="the KDA gated o_norm uses eps 1e-6 instead of rms_norm_eps",
        target="k3verify.serving.layers.kda:KimiDeltaAttention.__init__",
        old="self.o_norm = GatedRMSNorm(dk, cfg.rms_norm_eps)", new="self.o_norm = GatedRMSNorm(dk, 1e-6)",
        killers=NORMS, presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="norm.eps.routed_expert_norm",
        fault="LatentMoE's routed_expert_norm uses eps 1e-6 instead of rms_norm_eps",
        target="k3verify.serving.layers.moe:SparseMoE.__init__",
        old="self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps, dtype)",
        new="self.routed_expert_norm = RMSNorm(L, 1e-6, dtype)",
        killers=NORMS,
    ),
    Mutant(
        id="attn_res.eps.layer_mix", quick=True,
        fault="the depth mixer inside the layers normalizes its keys with eps 1e-6 instead of rms_norm_eps",
        target=f"{DEC}:DecoderLayer.__init__",
        old="self.layer_idx, self.eps = layer_idx, eps", new="self.layer_idx, self.eps = layer_idx, 1e-6",
        killers=["attn_res.module.*"],
    ),
    Mutant(
        id="attn_res.eps.output_mix",
        fault="the model-level output mix normalizes its keys with eps 1e-6 instead of rms_norm_eps",
        target=f"{MODEL}:ServingModel.finish",
        old="self.model.output_attn_res_proj.weight, self.cfg.rms_norm_eps)",
        new="self.model.output_attn_res_proj.weight, 1e-6)",
        killers=["attn_res.module.*"],
    ),
    Mutant(
        id="attn_res.softmax_in_bf16", quick=True,
        fault="the depth mixer's softmax runs on scores rounded to the activation dtype (bf16) instead of fp32",
        target=f"{RES}:attn_res_mix",
        old="alpha = torch.softmax(scores, dim=-1)", new="alpha = torch.softmax(scores.to(p.dtype), dim=-1)",
        killers=["attn_res.module.bf16"],
    ),
    Mutant(
        id="attn_res.scores_in_bf16",
        fault="the depth mixer's key norm and score reduction run in the activation dtype (bf16) instead of fp32",
        target=f"{RES}:attn_res_mix",
        old="scores = torch.stack([_score(blocks[:, i].float(), w, eps) for i in range(n)] + "
            "[_score(p.float(), w, eps)],",
        new="scores = torch.stack([_score(blocks[:, i], w.to(p.dtype), eps) for i in range(n)] + "
            "[_score(p, w.to(p.dtype), eps)],",
        killers=["attn_res.module.bf16"],
    ),
    Mutant(
        id="attn_res.accumulate_in_bf16",
        fault="the depth mixer accumulates its alpha-weighted sources in the activation dtype (bf16) instead of fp32",
        target=f"{RES}:attn_res_mix",
        old="out = out + alpha[:, i, None] * blocks[:, i].float()",
        new="out = (out + alpha[:, i, None] * blocks[:, i].float()).to(p.dtype).float()",
        also=(("return (out + alpha[:, n, None] * p.float()).to(p.dtype)",
               "return (out.to(p.dtype).float() + alpha[:, n, None] * p.float()).to(p.dtype)"),),
        killers=["attn_res.module.bf16"], presets=("k3-tiny", "k3-syn-25"),
    ),
    Mutant(
        id="mla.decode.softmax_in_bf16", quick=True,
        fault="the absorbed MLA decode's softmax runs exp, sum and division in bf16 instead of fp32",
        target=f"{MLA}:attention_probs",
        old="return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)",
        new="e = (scores - scores.amax(dim=-1, keepdim=True)).exp()\n"
            "    return (e / e.sum(dim=-1, keepdim=True)).to(dtype)",
        killers=["mla.decode.bf16"],
    ),
    Mutant(
        id="mla.decode.softmax_inlined_bf16",
        fault="the absorbed MLA decode inlines its own softmax in bf16, bypassing the fp32 one",
        target=f"{MLA}:MultiHeadLatentAttention._decode_absorbed",
        old="probs = attention_probs(scores, q.dtype)",
        new="probs = (scores - scores.amax(dim=-1, keepdim=True)).exp()\n"
            "        probs = probs / probs.sum(dim=-1, keepdim=True)",
        killers=["mla.decode.bf16"],
    ),
    Mutant(
        id="norm.reduction_in_bf16",
        fault="RMSNorm squares, averages and normalizes in the activation dtype (bf16) instead of fp32",
        target="k3verify.kernels.norm.torch_ref:rms_norm_torch",
        old="    x32 = x.float()\n    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)\n"
            "    return weight * normed.to(x.dtype)",
        new="    x32 = x\n    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)\n"
            "    return weight * normed.to(x.dtype)",
        killers=["norm.sites.bf16"],
    ),
    Mutant(
        id="norm.mean_square_in_activation_dtype",
        fault="RMSNorm sums its fp32 squares in an accumulator of the activation dtype (bf16: rounded after every "
              "add) instead of fp32; the squares, the normalization and the output cast stay as they are",
        target="k3verify.kernels.norm.torch_ref:rms_norm_torch",
        old="x32.pow(2).mean(dim=-1, keepdim=True) + eps)\n    return weight * normed.to(x.dtype)",
        new=MEAN_SQUARE_IN_X_DTYPE + " + eps)\n"
            "    return weight * normed.to(x.dtype)",
        killers=["norm.sites.bf16"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="norm.gated_mean_square_in_activation_dtype",
        fault="the gated RMSNorm (KDA o_norm) sums its fp32 squares in an accumulator of the activation dtype "
              "instead of fp32; everything else stays in fp32 with one cast at the end",
        target="k3verify.kernels.norm.torch_ref:gated_rms_norm_torch",
        old="x32.pow(2).mean(dim=-1, keepdim=True) + eps)\n    return (normed * weight.float()",
        new=MEAN_SQUARE_IN_X_DTYPE + " + eps)\n"
            "    return (normed * weight.float()",
        killers=["norm.sites.bf16"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="mlp.situ.betas_from_swapped_keys", quick=True,
        fault="SiTU reads beta from activation_situ_linear_beta and beta_lin from activation_situ_beta",
        target="k3verify.serving.layers.mlp:glu_activation",
        old="beta, lin = cfg.situ_beta, cfg.situ_linear_beta", new="beta, lin = cfg.situ_linear_beta, cfg.situ_beta",
        killers=["mlp.act.*", "mlp.module.*", "moe.module.*"],
    ),
    Mutant(
        id="router.topk_group_from_group_count",
        fault="the router reads topk_group from num_expert_group, so grouped top-k never restricts the groups",
        target="k3verify.serving.layers.moe:Router.__init__",
        old="cfg.num_experts_per_token, cfg.num_expert_group, cfg.topk_group",
        new="cfg.num_experts_per_token, cfg.num_expert_group, cfg.num_expert_group",
        killers=["router.*", "moe.*"], presets=("k3-skew-10",),
    ),
    Mutant(
        id="mla.scale_from_v_head_dim",
        fault="the MLA softmax scale reads v_head_dim where qk_rope_head_dim belongs: (qk_nope + v_head)^-0.5",
        target=f"{MLA}:MultiHeadLatentAttention.__init__",
        old="self.scale = cfg.qk_head_dim**-0.5", new="self.scale = (cfg.qk_nope_head_dim + cfg.v_head_dim)**-0.5",
        killers=["mla.*"], presets=("k3-skew-10",),
    ),
]
