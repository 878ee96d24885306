"""Packing, engine, cache and norm faults: segment ids, eos handling, the state pool, CUDA-graph buffers."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

MUTANTS = [
    Mutant(
        id="serving.pack.bucketize_right_false", quick=True,
        fault="segment ids come from bucketize(right=False): every sequence's first token lands in the previous one",
        target="k3verify.serving.batch:segment_ids",
        old="return torch.bucketize(positions, cu_seqlens, right=True) - 1",
        new="return torch.bucketize(positions, cu_seqlens, right=False) - 1",
        killers=["serving.*", "kda.*", "mla.*"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="serving.engine.one_eos_only",
        fault="the engine stops only at the first eos id (tokenizer_config's) and runs past generation_config's",
        target="k3verify.serving.engine:Engine.__init__",
        old="self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)",
        new="self.eos_token_ids = frozenset(int(e) for e in list(eos_token_ids)[:1])",
        killers=["serving.*"],
    ),
    Mutant(
        id="serving.state_pool.scratch_handed_out",
        fault="the KDA state pool hands out the reserved scratch slot 0, where padded rows park",
        target="k3verify.serving.state_cache:KDAStatePool.__init__",
        old="self._free: deque[int] = deque(range(1, n))",
        new="self._free: deque[int] = deque(range(0, n - 1))",
        killers=["serving.*"],
    ),
    Mutant(
        id="serving.state_pool.slot_not_zeroed",
        fault="a newly allocated KDA slot keeps the previous owner's state and conv windows",
        target="k3verify.serving.state_cache:KDAStatePool.allocate",
        old="        for t in self.tensors().values():\n            t[:, slot].zero_()\n",
        new="",
        killers=["serving.*"],
    ),
    Mutant(
        id="norm.weight_applied_before_cast",
        fault="RMSNorm multiplies by its weight in fp32 and casts once, instead of casting back first (bf16 only)",
        target="k3verify.kernels.norm.torch_ref:rms_norm_torch",
        old="return weight * normed.to(x.dtype)",
        new="return (weight.float() * normed).to(x.dtype)",
        killers=["norm.*", "kda.*", "mla.*", "moe.*", "model.*"],
    ),
    Mutant(
        id="serving.graph.signature_pointer_only", devices=("cuda",),
        fault="the CUDA-graph capture signature records cache data pointers only, so a shrunk cache at the same "
              "address replays stale slice offsets",
        target="k3verify.serving.graphs:capture_signature",
        old="return tuple((name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))",
        new="return tuple((name, t.data_ptr(), (), (), str(t.dtype))",
        killers=["serving.graph.*"],
    ),
    Mutant(
        id="serving.graph.padding_on_live_slot",
        fault="padded rows of a graph bucket park on the last live sequence's state slot instead of the scratch "
              "slot: their dummy decode writes into that sequence's KDA state and conv window",
        target="k3verify.serving.graphs:StaticInputs.fill",
        old="*[0] * pad, *slots, *[SCRATCH] * pad,",
        new="*[0] * pad, *slots, *(slots[-1:] or [SCRATCH]) * pad,",
        also=[("self.meta, [*slots, *[SCRATCH] * pad,", "self.meta, [*slots, *(slots[-1:] or [SCRATCH]) * pad,")],
        killers=["serving.graph.*", "serving.engine.step_loop*"],
    ),
    Mutant(
        id="serving.step.first_token_not_stored",
        fault="the step loop stores only decode rows' sampled tokens on the device: a sequence's first decode "
              "after its prefill feeds whatever its slot held",
        target="k3verify.serving.step_loop:StepLauncher.launch",
        old="self.runner.set_next_tokens(seq_ids, token_ids)",
        new="self.runner.set_next_tokens(seq_ids[len(seq_ids) - len(plan.decode):], "
            "token_ids[len(seq_ids) - len(plan.decode):])",
        killers=["serving.engine.step_loop_vs_offline"],
    ),
    Mutant(
        id="serving.step.decode_position_plus_one",
        fault="decode_next places each new token one position late (its cached count + 1)",
        target="k3verify.serving.runner:ModelRunner.decode_next",
        old="slots, positions = [s.slot for s in states], [s.cached for s in states]",
        new="slots, positions = [s.slot for s in states], [s.cached + 1 for s in states]",
        killers=["serving.engine.step_loop_logprobs"],
    ),
    Mutant(
        id="serving.sched.continuation_chunk_drops_token",
        fault="a prompt chunk that continues a sequence starts one token late (the boundary token is lost)",
        target="k3verify.serving.scheduler:Scheduler._chunk",
        old="plan.prefill.append(PrefillChunk(seq, start, start + n))",
        new="plan.prefill.append(PrefillChunk(seq, start + (start > 0), start + n))",
        killers=["serving.engine.step_loop_vs_offline"],
    ),
    Mutant(
        id="serving.fused.weights_not_aliased",
        fault="a fused projection's members get copies of their blocks: loading fills the copies and the one GEMM "
              "reads a weight nothing wrote",
        target="k3verify.serving.layers.fused:FusedLinears.__init__",
        old="lin.weight = nn.Parameter(block, requires_grad=False)",
        new="lin.weight = nn.Parameter(block.clone(), requires_grad=False)",
        killers=["kda.module.bf16", "mla.module.bf16"],
    ),
    Mutant(
        id="serving.prefill_graph.filler_on_live_slot",
        fault="a prefill bucket's filler and empty sequences park on the last live sequence's state slot instead of "
              "the scratch slot: their final state overwrites that sequence's KDA state",
        target="k3verify.serving.prefill_graphs:PrefillInputs.values",
        old="*map(int, slots),\n                *[SCRATCH] * (s.num_seqs - n),",
        new="*map(int, slots),\n                *([int(slots[-1])] if n else [SCRATCH]) * (s.num_seqs - n),",
        killers=["serving.prefill_graph.*"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="serving.prefill_graph.empty_offsets_zero",
        fault="a prefill bucket's empty trailing sequences get offsets 0 instead of the pack's end: the offsets stop "
              "rising and the segment ids of the pack's tokens go wrong",
        target="k3verify.serving.prefill_graphs:PrefillInputs.values",
        old="cu += [cu[-1]] * (s.num_seqs - count)",
        new="cu += [0] * (s.num_seqs - count)",
        killers=["serving.prefill_graph.*"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="serving.prefill_graph.attention_across_sequences",
        fault="the static pack's causal attention lets each sequence see every earlier token of the pack",
        target="k3verify.kernels.attn.packed:causal_attention_static_torch",
        old="[(cu[i], cu[i + 1], 0) for i in range(len(cu) - 1)]",
        new="[(0, cu[i + 1], cu[i]) for i in range(len(cu) - 1)]",
        killers=["serving.prefill_graph.*"], presets=("k3-tiny", "kl-tiny"),
    ),
]
