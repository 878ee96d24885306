"""MLA faults: masks, the output gate, the LoRA norms, the softmax scale and the latent cache."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

MLA = "k3verify.serving.layers.mla"

MUTANTS = [
    Mutant(
        id="mla.mask.plain_triangle", quick=True,
        fault="packed prefill uses one causal triangle over the whole pack, so sequence 2 attends to sequence 1",
        target=f"{MLA}:key_ranges",
        old="return [(key_cu[i], key_cu[i + 1], batch.start_list[i]) for i in range(batch.num_seqs)]",
        new="return [(0, key_cu[i + 1], key_cu[i] + batch.start_list[i]) for i in range(batch.num_seqs)]",
        killers=["mla.*", "serving.packed.*"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="mla.prefix.keys_shifted",
        fault="the keys of a pack with continuing sequences are laid out with every sequence's offset taken from "
              "the first sequence's length: the second and later sequences read other positions' latents",
        target=f"{MLA}:context_rows",
        old="first = torch.cumsum(lens, 0) - lens",
        new="first = torch.cumsum(lens, 0) - lens[:1]",
        killers=["serving.*", "mla.*"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="mla.gate.dropped", quick=True,
        fault="K3's MLA output gate sigmoid(g_proj(x)) is never applied",
        target=f"{MLA}:MultiHeadLatentAttention.forward",
        old="out = out * torch.sigmoid(gate[0])",
        new="out = out",
        killers=["mla.*"],
    ),
    Mutant(
        id="mla.gate.after_o_proj",
        fault="the MLA output gate is applied after o_proj (gate logits projected to hidden width) instead of before",
        target=f"{MLA}:MultiHeadLatentAttention.forward",
        old="            out = out * torch.sigmoid(gate[0])\n        return self.o_proj(out)",
        new="            return self.o_proj(out) * torch.sigmoid(self.o_proj(gate[0]))\n"
            "        return self.o_proj(out)",
        killers=["mla.*"],
    ),
    Mutant(
        id="mla.lora_norm.eps_1e5", quick=True,
        fault="the two MLA LoRA norms use rms_norm_eps 1e-5 instead of their own 1e-6",
        target=f"{MLA}:LORA_NORM_EPS",
        old="LORA_NORM_EPS = 1e-6",
        new="LORA_NORM_EPS = 1e-5",
        killers=["mla.*"],
    ),
    Mutant(
        id="mla.scale.nope_only",
        fault="the softmax scale uses qk_nope_head_dim^-0.5 instead of (qk_nope + qk_rope)^-0.5",
        target=f"{MLA}:MultiHeadLatentAttention.__init__",
        old="self.scale = cfg.qk_head_dim**-0.5",
        new="self.scale = cfg.qk_nope_head_dim**-0.5",
        killers=["mla.*"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="mla.latent.kv_norm_skipped",
        fault="the latent c goes into the cache (and kv_b_proj) without kv_a_layernorm",
        target=f"{MLA}:MultiHeadLatentAttention.latent",
        old="return torch.cat([self.kv_a_layernorm(c), k_rot], dim=-1)",
        new="return torch.cat([c, k_rot], dim=-1)",
        killers=["mla.*"],
    ),
    Mutant(
        id="mla.decode.sees_one_past_context",
        fault="absorbed decode admits one latent past the context (a stale or scratch row joins the softmax)",
        target=f"{MLA}:decode_rows",
        old="valid = pos < lens[:, None]",
        new="valid = pos <= lens[:, None]",
        killers=["mla.*", "serving.*"],
    ),
    Mutant(
        id="mla.decode.rope_part_ignored", quick=True,
        fault="absorbed decode scores only the latent (nope) part, dropping the shared k_rot dot product",
        target=f"{MLA}:MultiHeadLatentAttention._decode_absorbed",
        old='(torch.einsum("bhr,blr->bhl", q_lat, c) + torch.einsum("bhd,bld->bhl", q_rope, k_rot))',
        new='(torch.einsum("bhr,blr->bhl", q_lat, c))',
        killers=["mla.*", "serving.*"],
    ),
    Mutant(
        id="mla.cache.page_offset_rotated",
        fault="latent-cache rows rotate the in-page offset by one ((pos + 1) mod page_size)",
        target="k3verify.serving.kv_cache:PagedLatentCache.rows",
        old="return pages * self.page_size + positions % self.page_size",
        new="return pages * self.page_size + (positions + 1) % self.page_size",
        killers=["serving.*"],
        equivalent="rows() is the only address map for both writes and reads of the latent cache; for a fixed page "
                   "(p+1) mod page_size permutes the slots of that page, so no two tokens collide and every read "
                   "finds the latent written for it",
    ),
]
