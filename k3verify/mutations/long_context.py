"""Faults only long sequences show: past 64 pages, past one 1,024-row attention query block, past a few hundred
tokens routed to one expert in one call. The checks of a few hundred tokens cannot see them; the long-context
check (serving.long_context.logits, full suite: ~4,000 tokens in four prefill segments) must."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

LONG = ("serving.long_context.*",)

MUTANTS = [
    Mutant(
        id="long.kv_cache.page_index_wraps_at_64",
        fault="the latent cache's page index wraps past 64 pages (a 6-bit page field): token 1,024 onwards (pages "
              "of 16) overwrites the keys of the first 64 pages",
        target="k3verify.serving.kv_cache:PagedLatentCache.rows",
        old="pages = page_table[seq, positions // self.page_size]",
        new="pages = page_table[seq, (positions // self.page_size) % 64]",
        killers=LONG, presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="long.moe.expert_capacity_drops_tokens",
        fault="each expert takes at most 384 tokens per call (a capacity factor): the tokens past it get no "
              "contribution from that expert",
        target="k3verify.serving.layers.moe:SparseMoE.combine",
        old="            rows = tokens[start:start + count]\n",
        new="            rows = tokens[start:start + min(count, 384)]\n",
        also=(("            out.index_add_(0, rows, ye.float() * w_sorted[start:start + count, None])\n",
               "            out.index_add_(0, rows, ye.float() * w_sorted[start:start + min(count, 384), None])\n"),),
        killers=LONG, presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="long.attn.query_block_offset",
        fault="the attention's query blocks past the first all use the first block's offset: queries past row 1,024 "
              "of one prefill see only the keys of their row within the block",
        target="k3verify.kernels.attn.torch_ref:causal_attention",
        old="out[:, q0:q1] = _block(q[:, q0:q1], k, v, offset + q0, scale)",
        new="out[:, q0:q1] = _block(q[:, q0:q1], k, v, offset, scale)",
        killers=LONG, presets=("k3-tiny", "kl-tiny"),
    ),
]
