"""KDA faults: the layer (serving/layers/kda.py), its causal conv and its recurrence kernels."""

from __future__ import annotations

from typing import Any

from k3verify.gates.mutation.runner import Mutant

KDA = "k3verify.serving.layers.kda"
CONV = "k3verify.kernels.conv.torch_ref"
REC = "k3verify.kernels.kda.torch_ref"


def cut_mid_chunk(original: Any) -> Any:
    """Cut prefill segments one token short of the 64-token grid AND drop the guard that refuses such cuts
    (the guard alone would turn the fault into a loud error; the fault modelled is a silent mid-chunk cut)."""
    import k3verify.serving.layers.kda as kda

    kda.check_pieces = lambda seq_lens, pieces: None

    def segment_pieces(seq_lens: list[int], segment_len: int | None) -> list[list[tuple[int, int]]]:
        if segment_len is None:
            return original(seq_lens, segment_len)
        step = segment_len - 1
        return [[(s, min(s + step, n)) for s in range(0, n, step)] for n in seq_lens]

    return segment_pieces


MUTANTS = [
    Mutant(
        id="kda.beta.sigmoid_twice", quick=True,
        fault="beta is passed through sigmoid twice (the layer applies it and a kernel applies it again)",
        target=f"{REC}:kda_beta",
        old="return torch.sigmoid(b_logits.float())",
        new="return torch.sigmoid(torch.sigmoid(b_logits.float()))",
        killers=["kda.*"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="kda.beta.never_sigmoided",
        fault="beta is used as raw b_proj logits (nobody applies the sigmoid)",
        target=f"{REC}:kda_beta",
        old="return torch.sigmoid(b_logits.float())",
        new="return b_logits.float()",
        killers=["kda.*"],
    ),
    Mutant(
        id="kda.gate.softplus_for_safe_gate", quick=True,
        fault="K3's safe gate L*sigmoid(exp(A)*g) is replaced by the plain -exp(A)*softplus(g) gate",
        target=f"{REC}:kda_forget_gate",
        old="return lower_bound * torch.sigmoid(A * raw)",
        new="return -A * F.softplus(raw)",
        killers=["kda.*"],
    ),
    Mutant(
        id="kda.gate.a_log_last_heads",
        fault="A_log is sliced from the end ([-heads:]) instead of the first `heads` entries of the padded vector",
        target=f"{KDA}:KimiDeltaAttention.a_log_row",
        old="row = self.A_log.float().reshape(-1)[: self.heads]",
        new="row = self.A_log.float().reshape(-1)[-self.heads :]",
        killers=["kda.*"],
    ),
    Mutant(
        id="kda.gate.a_log_ignored",
        fault="the plain gate drops the per-head decay rate exp(A_log): g = -softplus(f)",
        target=f"{REC}:kda_forget_gate",
        old="return -A * F.softplus(raw)",
        new="return -F.softplus(raw)",
        killers=["kda.*"], presets=("kl-tiny",),
    ),
    Mutant(
        id="kda.gate.dt_bias_dropped",
        fault="the forget-gate bias dt_bias is never added",
        target=f"{REC}:kda_forget_gate",
        old="raw = torch.add(f_raw, dt_bias.float())",
        new="raw = f_raw.float()",
        killers=["kda.*"],
    ),
    Mutant(
        id="kda.qk.l2norm_dropped", quick=True,
        fault="q and k are not L2-normalized before the recurrence",
        target=f"{REC}:l2_normalize",
        old="return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)",
        new="return x",
        killers=["kda.*", "kernel.kda.*"],
    ),
    Mutant(
        id="kda.q.scale_missing",
        fault="q is not scaled by head_dim^-0.5",
        target=f"{KDA}:KimiDeltaAttention.forward",
        old="scale = dk**-0.5  # q's scale, decode and prefill alike",
        new="scale = 1.0  # q's scale, decode and prefill alike",
        killers=["kda.*"],
    ),
    Mutant(
        id="kda.norm.gate_not_sigmoided",
        fault="the gated o_norm multiplies by the raw output-gate logits instead of sigmoid(gate)",
        target="k3verify.kernels.norm.torch_ref:gated_rms_norm_torch",
        old="return (normed * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)",
        new="return (normed * weight.float() * gate.float()).to(x.dtype)",
        killers=["kda.*"],
    ),
    Mutant(
        id="kda.conv.leaks_across_sequences", quick=True,
        fault="the causal conv window reaches into the previous sequence of the pack (no zero-pad per sequence)",
        target=f"{CONV}:_sources",
        old="inside = local_pos >= shift",
        new="inside = torch.arange(seg_ids.numel(), device=seg_ids.device) >= shift",
        killers=["kda.*"],
    ),
    Mutant(
        id="kda.conv.silu_dropped",
        fault="the short conv output skips its SiLU",
        target=f"{CONV}:causal_conv_varlen_torch",
        old="y = torch.nn.functional.silu(acc)",
        new="y = acc",
        killers=["kda.*"],
    ),
    Mutant(
        id="kda.conv.silu_dropped_everywhere",
        fault="the short conv skips its SiLU on every path (prefill and decode): the convention "
              "kda.conv_activation=none, served",
        target=f"{CONV}:causal_conv_varlen_torch",
        old="y = torch.nn.functional.silu(acc)",
        new="y = acc",
        also=(("q, k, v = (torch.nn.functional.silu(a) for a in acc)", "q, k, v = (a for a in acc)"),),
        killers=["endpoint.greedy.tokens", "endpoint.logprobs.topk"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="kda.conv.fp32_weight_not_cast",
        fault="K3's fp32 conv weights are used as shipped instead of cast to the activation dtype before the conv",
        target=f"{KDA}:KimiDeltaAttention.conv_weights",
        old="lambda: tuple(c.weight.to(dtype).reshape(c.weight.shape[0], -1) for c in convs)",
        new="lambda: tuple(c.weight.reshape(c.weight.shape[0], -1) for c in convs)",
        killers=["kda.*"],
    ),
    Mutant(
        id="kda.gate.activation_between_f_a_f_b",
        fault="a SiLU is inserted between f_a_proj and f_b_proj (the forget-gate low-rank pair has no activation)",
        target=f"{KDA}:KimiDeltaAttention.forget_gate_input",
        old="return self.f_b_proj(f_a)",
        new="return self.f_b_proj(torch.nn.functional.silu(f_a))",
        killers=["kda.*"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="kda.decode.conv_state_not_advanced",
        fault="decode steps read the conv windows but never store the advanced windows back",
        target=f"{CONV}:causal_conv_decode_torch",
        old="    for win, new in zip(windows, shifted, strict=True):\n        win.index_copy_(0, slots, new)\n",
        new="",
        killers=["serving.*", "kda.*", "kernel.conv.*"],
    ),
    Mutant(
        id="kda.decode.conv_window_not_shifted",
        fault="a decode step writes its input into the newest window tap but leaves the older taps where they were",
        target=f"{CONV}:causal_conv_decode_torch",
        old="shifted = taps[..., 1:].float()",
        new="shifted = torch.cat([taps[..., :-2], taps[..., -1:]], dim=-1).float()",
        killers=["serving.*", "kda.*", "kernel.conv.*"],
    ),
    Mutant(
        id="kda.decode.conv_keep_ignored",
        fault="a fresh sequence (keep=0) in a decode step convolves the stale window left in its slot "
              "(serving never decodes a fresh row, so only the kernel check can see it)",
        target=f"{CONV}:causal_conv_decode_torch",
        old="    old = old * keep.to(dtype)[None, :, None, None]",
        new="    old = old * 1",
        killers=["kernel.conv.*"],
    ),
    Mutant(
        id="kda.decode.conv_taps_reversed",
        fault="a decode step pairs the newest input with the oldest weight tap (the window read backwards)",
        target=f"{CONV}:causal_conv_decode_torch",
        old="        acc = acc + taps[..., tap] * weight[..., tap]",
        new="        acc = acc + taps[..., W - 1 - tap] * weight[..., tap]",
        killers=["serving.*", "kda.*", "kernel.conv.*"],
    ),
    Mutant(
        id="kda.decode.state_not_stored", quick=True,
        fault="the recurrent state after a decode step is never written back to the state pool",
        target=f"{REC}:kda_decode_slots_torch",
        old="pool_state.index_copy_(0, slots, final.to(pool_state.dtype))",
        new="_ = final",
        killers=["serving.*", "kda.*"],
    ),
    Mutant(
        id="kda.decode.slot_off_by_one",
        fault="a decode step reads the recurrent state of the neighbouring slot (slots - 1)",
        target=f"{REC}:kda_decode_slots_torch",
        old="kda_decode_torch(q, k, v, g, beta, pool_state.index_select(0, slots), scale)",
        new="kda_decode_torch(q, k, v, g, beta, pool_state.index_select(0, slots - 1), scale)",
        killers=["serving.*", "kda.*"],
    ),
    Mutant(
        id="kda.decode.no_decay",
        fault="the one-token decode step forgets to decay the state by exp(g)",
        target=f"{REC}:kda_decode_torch",
        old="S = state.to(cdt) * g.to(cdt).exp()[..., None]",
        new="S = state.to(cdt)",
        killers=["kda.*", "serving.*", "kernel.kda.*"],
    ),
    Mutant(
        id="kda.prefill.cut_mid_chunk", quick=True, kind="patch", patch=cut_mid_chunk,
        fault="long prefill is cut into segments off the 64-token chunk grid (and nothing refuses the cut)",
        target=f"{KDA}:segment_pieces",
        killers=["kda.*", "serving.*"],
    ),
    Mutant(
        id="kda.state.slot_off_by_one", quick=True,
        fault="the state pool reads the recurrent state of the neighbouring slot (slots - 1)",
        target="k3verify.serving.state_cache:KDAStatePool.read_state",
        old="return self.state[self.layer_index[layer]].index_select(0, slots)",
        new="return self.state[self.layer_index[layer]].index_select(0, slots - 1)",
        killers=["serving.*", "kda.*"],
    ),
]
