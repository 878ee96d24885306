"""Block Attention Residual faults: the mix, the block list and where the model applies them."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

RES = "k3verify.serving.layers.attn_res"
DEC = "k3verify.serving.layers.decoder"
MODEL = "k3verify.serving.model"

MUTANTS = [
    Mutant(
        id="attn_res.mixed_h_into_accumulator", quick=True,
        fault="the mixed h (meant only for the norms) is carried on as the running partial sum p",
        target=f"{DEC}:DecoderLayer.forward_attn_res",
        old="running: torch.Tensor | None = p",
        new="running: torch.Tensor | None = h",
        killers=["attn_res.*", "model.*"],
    ),
    Mutant(
        id="attn_res.block_boundary_no_reset",
        fault="at a block boundary p is appended to the block list but not reset, so it is counted twice",
        target=f"{DEC}:DecoderLayer.forward_attn_res",
        old="            blocks.append(p)\n            running = None",
        new="            blocks.append(p)",
        killers=["attn_res.*", "model.*"],
    ),
    Mutant(
        id="attn_res.block_boundary_off_by_one",
        fault="blocks close at layers l with (l + 1) % block_size == 0 instead of l % block_size == 0",
        target=f"{DEC}:DecoderLayer.forward_attn_res",
        old="if self.layer_idx % self.block_size == 0:",
        new="if (self.layer_idx + 1) % self.block_size == 0:",
        killers=["attn_res.*", "model.*"],
    ),
    Mutant(
        id="attn_res.output_mix_skipped",
        fault="the model-level output mix (output_attn_res_norm/proj) before the final norm is skipped",
        target=f"{MODEL}:ServingModel.finish",
        old="            x = attn_res_mix(x, blocks.view(),",
        new="            x = x if True else attn_res_mix(x, blocks.view(),",
        killers=["attn_res.*", "model.*"],
    ),
    Mutant(
        id="attn_res.output_mix_after_final_norm", quick=True,
        fault="the output mix runs after the final norm (norm-then-mix) instead of mix-then-norm",
        target=f"{MODEL}:ServingModel.finish",
        old="            x = attn_res_mix(x, blocks.view(),",
        new="            return attn_res_mix(self.model.norm(x), blocks.view(),",
        killers=["attn_res.*", "model.*"],
    ),
    Mutant(
        id="attn_res.full_width_block_view", quick=True,
        fault="the preallocated (zeroed) block buffer is passed whole, so its unused zero columns join the softmax",
        target=f"{RES}:BlockBuffer.view",
        old="return self.data[:, : self.n]",
        new="return self.data",
        also=(("self.data = torch.empty(tokens, max_blocks", "self.data = torch.zeros(tokens, max_blocks"),),
        killers=["attn_res.*", "model.*"], presets=("k3-tiny", "k3-syn-25"),
    ),
    Mutant(
        id="attn_res.mix_scaled_by_sqrt_d",
        fault="the mix softmax divides the scores by sqrt(hidden) (there is no 1/sqrt(d) in attention residuals)",
        target=f"{RES}:attn_res_mix",
        old="alpha = torch.softmax(scores, dim=-1)",
        new="alpha = torch.softmax(scores / p.shape[-1] ** 0.5, dim=-1)",
        killers=["attn_res.*", "model.*"],
    ),
    Mutant(
        id="attn_res.norm_weight_ignored",
        fault="the mix scores use proj.weight alone, dropping the res-norm gain",
        target=f"{RES}:attn_res_mix",
        old="w = norm_weight.float() * proj_weight.float().reshape(-1)",
        new="w = proj_weight.float().reshape(-1)",
        killers=["attn_res.*", "model.*"],
    ),
    Mutant(
        id="attn_res.mix_returns_keys",
        fault="the mix weighs the normalized key K of the running sum p instead of its raw value V",
        target=f"{RES}:attn_res_mix",
        old="    return (out + alpha[:, n, None] * p.float()).to(p.dtype)",
        new="    k = p.float() * torch.rsqrt(p.float().pow(2).mean(dim=-1, keepdim=True) + eps)\n"
            "    return (out + alpha[:, n, None] * k).to(p.dtype)",
        killers=["attn_res.*", "model.*"],
    ),
]
