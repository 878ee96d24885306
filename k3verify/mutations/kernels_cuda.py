"""Faults in the CUDA fast paths (fla's Triton KDA behind kernels/kda/fla_launch.py, the fused Triton norms in
kernels/norm/norm_kernel.py, our Triton conv decode and prefill in kernels/conv/, the fused Triton router
selection in kernels/router/select_kernel.py, the MXFP4 grouped GEMM in kernels/mxfp4/grouped_kernel.py, the
MoE decode kernels in kernels/moe/decode_kernel.py, the KDA forget gate in kernels/kda/forget_gate_kernel.py).
They only run with
`k3verify mutate --device cuda`: on CPU the registry routes
to the torch reference and they cannot matter."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

FLA = "k3verify.kernels.kda.fla_launch"
NORM = "k3verify.kernels.norm.norm_kernel"
CONV = "k3verify.kernels.conv.decode_kernel"
CONV_PREFILL = "k3verify.kernels.conv.prefill_kernel"
ROUTER = "k3verify.kernels.router.select_kernel"
MXFP4 = "k3verify.kernels.mxfp4.grouped_kernel"
MOE_DECODE = "k3verify.kernels.moe.decode_kernel"
MOE_TAIL = "k3verify.kernels.moe.tail_kernel"
KDA_GATE = "k3verify.kernels.kda.forget_gate_kernel"
MXFP4_KILLERS = ["kernel.mxfp4.*", "moe.module.packed"]

MUTANTS = [
    Mutant(
        id="kernel.fla.prefill_beta_sigmoid_in_kernel", devices=("cuda",),
        fault="chunk_kda is called with use_beta_sigmoid_in_kernel=True on the already-sigmoided beta (twice)",
        target=f"{FLA}:kda_prefill_fla",
        old="use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,\n        safe_gate=",
        new="use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=True,\n        safe_gate=",
        killers=["kda.*", "serving.*"],
    ),
    Mutant(
        id="kernel.fla.prefill_qk_not_normalized", devices=("cuda",),
        fault="chunk_kda runs with use_qk_l2norm_in_kernel=False although nothing else normalizes q and k",
        target=f"{FLA}:kda_prefill_fla",
        old="output_final_state=True, use_qk_l2norm_in_kernel=True,\n        use_gate_in_kernel=False, "
            "use_beta_sigmoid_in_kernel=False,\n        safe_gate=",
        new="output_final_state=True, use_qk_l2norm_in_kernel=False,\n        use_gate_in_kernel=False, "
            "use_beta_sigmoid_in_kernel=False,\n        safe_gate=",
        killers=["kda.*", "serving.*"],
    ),
    Mutant(
        id="kernel.fla.decode_beta_sigmoid_in_kernel", devices=("cuda",),
        fault="the in-place (slot-indexed) fused_recurrent_kda squashes the already-sigmoided beta again",
        target=f"{FLA}:kda_decode_slots_fla",
        old="gate_in_kernel=False, beta_sigmoid_in_kernel=False)",
        new="gate_in_kernel=False, beta_sigmoid_in_kernel=True)",
        killers=["kernel.kda.*", "serving.*"],
    ),
    Mutant(
        id="kernel.fla.decode_gated_bias_dropped", devices=("cuda",),
        fault="the serving decode's in-kernel forget gate never adds dt_bias (None handed to fla)",
        target=f"{FLA}:kda_decode_slots_gated_fla",
        old="a_log=a_log, dt_bias=dt_bias,\n",
        new="a_log=a_log, dt_bias=None,\n",
        killers=["kernel.kda.*", "serving.*"],
    ),
    Mutant(
        id="kernel.fla.decode_gated_beta_raw", devices=("cuda",),
        fault="the serving decode hands fla raw beta logits with its in-kernel sigmoid off (nobody squashes beta)",
        target=f"{FLA}:kda_decode_slots_gated_fla",
        old="gate_in_kernel=True, beta_sigmoid_in_kernel=True,",
        new="gate_in_kernel=True, beta_sigmoid_in_kernel=False,",
        killers=["kernel.kda.*", "serving.*"],
    ),
    Mutant(
        id="kernel.norm.triton_weight_before_cast", devices=("cuda",),
        fault="the Triton RMSNorm multiplies by its weight in fp32 and casts once, instead of casting the "
              "normalized row back to x's dtype first",
        target=f"{NORM}:rms_norm_fwd_kernel",
        old="normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)",
        new="normed = x * rstd",
        killers=["kernel.norm.*"],
    ),
    Mutant(
        id="kernel.norm.add_rms_sum_not_rounded", devices=("cuda",),
        fault="the fused residual add + RMSNorm normalizes the fp32 sum instead of the sum rounded to bf16 (the "
              "stored stream and the normed row disagree by a rounding)",
        target=f"{NORM}:add_rms_norm_fwd_kernel",
        old="s32 = (x + r).to(s_ptr.dtype.element_ty).to(tl.float32)  # the stored s",
        new="s32 = (x + r)  # the stored s",
        killers=["kernel.norm.*"],
    ),
    Mutant(
        id="kernel.norm.triton_gate_not_sigmoided", devices=("cuda",),
        fault="the Triton gated RMSNorm multiplies by the raw gate logits instead of sigmoid(gate)",
        target=f"{NORM}:gated_rms_norm_fwd_kernel",
        old="out = x * rstd * w * (1.0 / (1.0 + tl.exp(-g)))",
        new="out = x * rstd * w * g",
        killers=["kernel.norm.*"],
    ),
    Mutant(
        id="kernel.conv.triton_window_not_shifted", devices=("cuda",),
        fault="the Triton decode conv writes each old window tap back in place instead of one position older",
        target=f"{CONV}:_conv_row",
        old="tl.store(win + (j - 1) * s_tap, tap, mask=mask)",
        new="tl.store(win + j * s_tap, tap, mask=mask)",
        killers=["kernel.conv.*", "serving.*"],
    ),
    Mutant(
        id="kernel.conv.triton_keep_ignored", devices=("cuda",),
        fault="the Triton decode conv ignores keep: a fresh sequence convolves the stale window of its slot",
        target=f"{CONV}:conv_decode_qkv_kernel",
        old="keep = tl.load(keep_ptr + b).to(tl.float32)",
        new="keep = tl.load(keep_ptr + b).to(tl.float32) * 0.0 + 1.0",
        killers=["kernel.conv.*"],
    ),
    Mutant(
        id="kernel.conv.triton_slot_ignored", devices=("cuda",),
        fault="the Triton decode conv reads and writes window row b (the batch row) instead of the row's slot",
        target=f"{CONV}:conv_decode_qkv_kernel",
        old="slot = tl.load(slots_ptr + b)",
        new="slot = tl.load(slots_ptr + b) * 0 + b",
        killers=["kernel.conv.*", "serving.*"],
    ),
    Mutant(
        id="kernel.conv.triton_prefill_leaks", devices=("cuda",),
        fault="the Triton prefill conv decides a tap is inside the pack by the token index, not the position in "
              "its sequence: every sequence's first taps read the previous sequence's last tokens",
        target=f"{CONV_PREFILL}:_conv_tokens",
        old="inside = pos >= shift",
        new="inside = t >= shift",
        killers=["kernel.conv.*", "serving.*", "kda.*"],
    ),
    Mutant(
        id="kernel.conv.triton_prefill_final_window_shifted", devices=("cuda",),
        fault="the Triton prefill conv stores each sequence's final window one token too early",
        target=f"{CONV_PREFILL}:_final_window",
        old="rel = tl.zeros_like(d) + (length - (W - 1) + j)",
        new="rel = tl.zeros_like(d) + (length - W + j)",
        killers=["kernel.conv.*", "serving.*", "kda.*"],
    ),
    Mutant(
        id="kernel.moe.decode_rows_past_first_block", devices=("cuda",),
        fault="the MoE decode kernels compute only an expert's first 16 routed rows: every later block repeats them",
        target=f"{MOE_DECODE}:_block_pairs",
        old="r = block * BLOCK_M + tl.arange(0, BLOCK_M)",
        new="r = tl.arange(0, BLOCK_M)",
        killers=["kernel.moe.*"],
    ),
    Mutant(
        id="kernel.moe.decode_cols_first_axes_crossed", devices=("cuda",),
        fault="the MoE decode kernels' column-first grid (steps past 128 pairs) reads its column block from the "
              "expert axis: programs compute the wrong columns",
        target=f"{MOE_DECODE}:_col_block",
        old="return tl.program_id(0) if COLS_FIRST else tl.program_id(1)",
        new="return tl.program_id(1)",
        killers=["kernel.moe.*", "serving.*"],
    ),
    Mutant(
        id="kernel.moe.decode_route_weight_dropped", devices=("cuda",),
        fault="the MoE decode down kernel stores the expert outputs without their route weights",
        target=f"{MOE_DECODE}:moe_down_kernel",
        old="* route_w[:, None]",
        new="* 1.0",
        killers=["kernel.moe.*", "serving.*"],
    ),
    Mutant(
        id="kernel.moe.decode_shared_not_added", devices=("cuda",),
        fault="the MoE decode finish launch casts the routed sum but never adds the shared expert's output",
        target=f"{MOE_DECODE}:moe_finish_kernel",
        old="acc = acc.to(shared.dtype).to(tl.float32) + shared.to(tl.float32)",
        new="acc = acc.to(shared.dtype).to(tl.float32)",
        killers=["kernel.moe.*", "serving.*"],
        # K3's LatentMoE adds its shared expert after the latent norm and up-projection, outside the combine:
        # on k3-tiny this line never runs (scored there, it survives: an equivalent pair)
        presets=("kl-tiny",),
    ),
    Mutant(
        id="kernel.moe.decode_finish_first_term_only", devices=("cuda",),
        fault="the MoE decode finish launch keeps each token's first route term and drops the other k-1",
        target=f"{MOE_DECODE}:moe_finish_kernel",
        old="    for j in tl.static_range(1, K_ROUTE):",
        new="    for j in tl.static_range(1, 1):",
        killers=["kernel.moe.*", "serving.*"],
    ),
    Mutant(
        id="kernel.moe.tail_route_weight_dropped", devices=("cuda",),
        fault="the grouped MoE combine's Triton tail sums the expert outputs without their route weights",
        target=f"{MOE_TAIL}:moe_sorted_sum_kernel",
        old="* tl.load(w_ptr + pair)",
        new="* 1.0",
        killers=["kernel.moe.*", "serving.*"],
    ),
    Mutant(
        id="kernel.moe.tail_rows_not_unsorted", devices=("cuda",),
        fault="the grouped MoE combine's Triton tail reads each pair's row at the pair's own index, not where the "
              "expert sort put it",
        target=f"{MOE_TAIL}:moe_sorted_sum_kernel",
        old="row = tl.load(inv_ptr + pair).to(tl.int64)",
        new="row = pair",
        killers=["kernel.moe.*", "serving.*"],
    ),
    Mutant(
        id="kernel.router.triton_weights_from_choice", devices=("cuda",),
        fault="the Triton router weights are the bias-corrected choice at the chosen ids, not the uncorrected "
              "sigmoid scores",
        target=f"{ROUTER}:router_select_kernel",
        old="w = tl.where(slots == j, tl.sum(tl.where(at, s, 0.0), axis=0), w)",
        new="w = tl.where(slots == j, tl.sum(tl.where(at, choice, 0.0), axis=0), w)",
        killers=["kernel.router.*"],
    ),
    Mutant(
        id="kernel.router.triton_ids_descending", devices=("cuda",),
        fault="the Triton router emits the chosen ids largest first instead of ascending",
        target=f"{ROUTER}:router_select_kernel",
        old="low = tl.min(tl.where(taken == 1, cols, BLOCK_E), axis=0)",
        new="low = tl.max(tl.where(taken == 1, cols, -1), axis=0)",
        killers=["kernel.router.*"],
    ),
    Mutant(
        id="kernel.attn.packed_prefix_as_causal", devices=("cuda",),
        fault="the one-call packed SDPA takes is_causal for every pack, prefixed ones too (is_causal aligns "
              "queries top-left: a continuation's queries lose their cached prefix)",
        target="k3verify.kernels.attn.packed:causal_attention_packed_sdpa",
        old="fresh = k_lens == q_lens and all(r[2] == 0 for r in ranges)",
        new="fresh = True",
        killers=["kernel.attn.packed_vs_torch"],
    ),
    Mutant(
        id="kernel.mxfp4.triton_nibbles_high_first", devices=("cuda",),
        fault="the Triton MXFP4 GEMM decodes each byte's high nibble as the earlier input column",
        target=f"{MXFP4}:mxfp4_grouped_mm_kernel",
        old="w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))",
        new="w = tl.reshape(tl.join(hi, lo), (BLOCK_N, BLOCK_K))",
        killers=MXFP4_KILLERS,
    ),
    Mutant(
        id="kernel.mxfp4.triton_scale_bias_off_by_one", devices=("cuda",),
        fault="the Triton MXFP4 GEMM decodes E8M0 scales as 2^(e - 126) instead of 2^(e - 127)",
        target=f"{MXFP4}:_e8m0",
        old="tl.where(s == 0, 0x00400000, s << 23)",
        new="tl.where(s == 0, 0x00400000, (s + 1) << 23)",
        killers=MXFP4_KILLERS,
    ),
    Mutant(
        id="kernel.mxfp4.triton_scale_group_off_by_one", devices=("cuda",),
        fault="the Triton MXFP4 GEMM scales each 32-value group by the previous group's E8M0 byte (the first "
              "group by 2^0): scale group boundaries one group late",
        target=f"{MXFP4}:mxfp4_grouped_mm_kernel",
        old="s = tl.load(s_rows + group[None, :], mask=col_ok[:, None] & g_ok[None, :], other=127)",
        new="s = tl.load(s_rows + group[None, :] - 1, mask=col_ok[:, None] & g_ok[None, :] & (group > 0)[None, :], "
            "other=127)",
        killers=MXFP4_KILLERS,
    ),
    Mutant(
        id="kernel.mxfp4.triton_wrong_expert_offset", devices=("cuda",),
        fault="the Triton MXFP4 GEMM multiplies each expert's rows by the previous expert's weights (expert "
              "offset into the stack off by one)",
        target=f"{MXFP4}:mxfp4_grouped_mm_kernel",
        old="w_expert = expert.to(tl.int64)",
        new="w_expert = tl.maximum(expert - 1, 0).to(tl.int64)",
        killers=MXFP4_KILLERS,
    ),
    Mutant(
        id="kernel.kda.gate_beta_bias_dropped", devices=("cuda",),
        fault="the one-launch prefill / score gate never adds dt_bias to f_b_proj's output",
        target=f"{KDA_GATE}:kda_forget_gate_beta_kernel",
        old="raw = tl.load(f_ptr + t * s_f + d, mask=m, other=0.0).to(tl.float32) + tl.load(dt_ptr + d, mask=m, "
            "other=0.0)",
        new="raw = tl.load(f_ptr + t * s_f + d, mask=m, other=0.0).to(tl.float32)",
        killers=["kernel.kda.*", "serving.*"],
    ),
    Mutant(
        id="kernel.kda.gate_beta_head_of_channel", devices=("cuda",),
        fault="the one-launch gate scales each channel by the decay rate of head (channel mod heads), not its own",
        target=f"{KDA_GATE}:kda_forget_gate_beta_kernel",
        old="A = tl.load(a_ptr + d // DK, mask=m, other=0.0)",
        new="A = tl.load(a_ptr + d % H, mask=m, other=0.0)",
        killers=["kernel.kda.*", "serving.*"],
    ),
    Mutant(
        id="kernel.fla.static_pack_without_offsets", devices=("cuda",),
        fault="a static (CUDA-graph) pack reaches fla's chunk_kda without its device offsets: the pack runs as one "
              "dense sequence",
        target=f"{FLA}:_varlen",
        old='return {"cu_seqlens": cu_seqlens.cu, "use_graph": True, "max_num_seqs": cu_seqlens.num_seqs}',
        new="return {}",
        killers=["kernel.kda.triton_vs_torch", "serving.prefill_graph.*"],
    ),
]
