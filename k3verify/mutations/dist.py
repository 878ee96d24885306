"""Tensor / expert parallel faults: a rank loads the wrong slice, a partial sum is never reduced, expert ids
are not offset per rank, partial sums are reduced in bf16. Each is killed by the dist.* checks (a gloo world
of 2 against the single-process model; dist.reduce.fp32 a world of 4 of its own). The last two change only the
arithmetic precision of a sum in bf16 runs and nothing in fp32 ones: only the bf16 checks can see them."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

PRESETS = ("k3-tiny", "kl-tiny")

MUTANTS = [
    Mutant(
        id="dist.slice.rank_offset_dropped",
        fault="every rank reads its tensor-parallel slice from offset 0 (same width, rank 0's rows)",
        target="k3verify.serving.parallel.shards:shard_spec",
        old="return SliceSpec(source, rule.dim, rule.start, rule.stop)",
        new="return SliceSpec(source, rule.dim, 0, rule.stop - rule.start)",
        killers=["dist.weights.slices", "dist.tp.logits", "dist.layout.logits", "dist.greedy"], presets=PRESETS,
    ),
    Mutant(
        id="dist.tp.attention_not_reduced", quick=True,
        fault="tensor-parallel KDA returns its partial sum over this rank's heads (the all-reduce is missing)",
        target="k3verify.serving.parallel.layers:tp_attention",
        old="KimiDeltaAttention(local, layer_idx, dtype, device, out_linear=row_parallel(comm),",
        # o_proj's collective over a world of one: the identity
        new="KimiDeltaAttention(local, layer_idx, dtype, device, "
            "out_linear=row_parallel(Comm(type(comm.layout)(1, 1))),",
        killers=["dist.tp.logits", "dist.layout.logits", "dist.greedy"], presets=PRESETS,
    ),
    Mutant(
        id="dist.ep.expert_ids_not_offset", quick=True,
        fault="a rank treats global expert ids as its local ids (no offset by its first expert)",
        target="k3verify.serving.parallel.moe:ParallelMoE.routed_partial",
        old="local = idx - self.first_expert",
        new="local = idx",
        killers=["dist.ep.logits", "dist.layout.logits", "dist.ep.empty_rank"], presets=PRESETS,
    ),
    Mutant(
        id="dist.reduce.bf16",
        fault="partial sums are all-reduced in bf16 where fp32 is required",
        target="k3verify.serving.parallel.comm:Comm.all_reduce",
        old="buf = t.float()",
        new="buf = t.to(torch.bfloat16)",
        killers=["dist.tp.logits", "dist.ep.logits", "dist.layout.logits"], presets=PRESETS,
    ),
    Mutant(
        id="dist.reduce.activation_dtype",
        fault="the collective sums in its input's dtype: a bf16 partial is reduced by a bf16 ring (one rounding per "
              "hop) instead of in fp32 with one rounding at the end",
        target="k3verify.serving.parallel.comm:Comm.all_reduce",
        old="buf = t.float()",
        new="buf = t.clone()",
        killers=["dist.reduce.fp32"], presets=PRESETS,
    ),
    Mutant(
        id="dist.ep.partial_rounded_before_reduce",
        fault="an expert-parallel rank rounds its fp32 partial sum of expert terms to the activation dtype before "
              "the all-reduce (bf16: a second rounding the single-process combine never makes)",
        target="k3verify.serving.parallel.moe:ParallelMoE.forward",
        old="routed = self.comm.all_reduce(routed)",
        new="routed = self.comm.all_reduce(routed.to(x.dtype))",
        also=(("return self.comm.all_reduce(routed).to(x.dtype) + self.shared_experts(x)",
               "return self.comm.all_reduce(routed.to(x.dtype)) + self.shared_experts(x)"),),
        killers=["dist.moe.bf16"], presets=PRESETS,
    ),
]
