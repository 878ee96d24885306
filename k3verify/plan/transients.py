"""Peak transient bytes of one prefill step, per rank: the tensors alive at the worst moment of each layer
kind, read off the code paths the served bf16 model runs on a GPU (fla's chunk_kda, SDPA for MLA prefill,
the grouped-GEMM MoE, torch convs and GLUs). Every term names the tensor it stands for; the GPU measurement
(`k3verify plan --measure`) prints the same terms next to the measured per-layer peaks.

Shape legend: T new tokens in the step, Tk keys the step's sequences attend to (cached prefix + new), B
sequences, H hidden, D = local KDA heads x dk, m local MLA heads, d bytes per activation element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3verify.config import ModelConfig
from k3verify.kernels.kda import CHUNK
from k3verify.serving.parallel.layout import ParallelLayout, local_config

FP32, INT64 = 4, 8


@dataclass(frozen=True)
class Step:
    tokens: int  # T
    keys: int  # Tk (>= T)
    seqs: int  # B
    dtype_bytes: int  # d


def _glu(T: int, inter: int, act: str, d: int) -> int:
    """Inside GatedMLP: gate and up outputs, then the activation's temporaries (SiTU works in fp32: g, u, two
    partial products and the result alive at once; SiLU: silu(g) and the product)."""
    gate_up = 2 * T * inter * d
    return gate_up + (5 * T * inter * FP32 if act == "situ" else 2 * T * inter * d)


def glu_bytes(cfg: ModelConfig, T: int, inter: int, d: int) -> int:
    return _glu(T, inter, cfg.hidden_act, d) + T * cfg.hidden_size * d  # + the down projection's output


def kda_bytes(cfg: ModelConfig, step: Step) -> dict[str, int]:
    """At chunk_kda's output (the layer's peak): its q/k/v/g/beta inputs and fla's intermediates."""
    T, d, h, dk = step.tokens, step.dtype_bytes, cfg.kda_num_heads, cfg.kda_head_dim
    D, chunks = h * dk, math.ceil(T / CHUNK) + step.seqs
    return {
        "q k v (after the convs)": 3 * T * D * d,
        "g (fp32 log decay) + beta": T * D * FP32 + T * h * FP32,
        "fla: l2-normed q k": 2 * T * D * d,
        "fla: chunk-cumsum g (fp32)": T * D * FP32,
        "fla: w u kg": 3 * T * D * d,
        "fla: Aqk Akk": 2 * T * h * CHUNK * d,
        "fla: chunk states h": chunks * h * dk * dk * d,
        "fla: v_new o": 2 * T * D * d,
    }


def mla_bytes(cfg: ModelConfig, step: Step) -> dict[str, int]:
    """At SDPA (the layer's peak): queries, latents, keys and values expanded over every key, the output."""
    T, Tk, d, m = step.tokens, step.keys, step.dtype_bytes, cfg.num_attention_heads
    width, prefix = cfg.mla_cache_width, Tk > T
    terms = {
        "q": T * m * cfg.qk_head_dim * d,
        "latent": T * width * d,
        "kv_b_proj over the keys (k_nope | v)": Tk * m * (cfg.qk_nope_head_dim + cfg.v_head_dim) * d,
        "k = [k_nope | k_rot]": Tk * m * cfg.qk_head_dim * d,
        "output + SDPA output": 2 * T * m * cfg.v_head_dim * d,
    }
    if prefix:  # SDPA's lower-right causal bias over the prefix: no [T, Tk] mask tensor (kernels/attn/sdpa.py)
        terms["cached latents gathered + their rows"] = Tk * width * d + 3 * Tk * INT64
    return terms


def moe_bytes(cfg: ModelConfig, layout: ParallelLayout, step: Step) -> dict[str, int]:
    """The worst of the MoE block's three phases: routing; the routed experts through the grouped GEMMs
    (uniform routing: this rank gets its experts' share of the T x top_k rows); the shared experts."""
    T, d, k, H = step.tokens, step.dtype_bytes, cfg.num_experts_per_token, cfg.hidden_size
    first, stop = layout.ep_range(cfg.num_experts)
    rows = math.ceil(T * k * (stop - first) / cfg.num_experts)
    Din, I = cfg.expert_in_dim, cfg.moe_intermediate_size
    x_in = T * Din * d if cfg.uses_latent_moe else 0
    act = 5 * rows * I * FP32 if cfg.hidden_act == "situ" else 2 * rows * I * d
    router = {"router: x in fp32, logits, scores, choice": T * H * FP32 + 3 * T * cfg.num_experts * FP32}
    routed = {  # the grouped GEMMs, then the Triton tail that weights and sums each token's rows in place
        "latent expert input": x_in,
        "gathered rows + gate|up": rows * Din * d + rows * 2 * I * d + 3 * rows * INT64,
        "max(activation temporaries, activation output + down output)": max(act, rows * (I + Din) * d),
    }
    if layout.world > 1:
        routed["EP dispatch: rows gathered per pair, fp32 partial sum"] = rows * Din * (d + FP32) + T * Din * FP32
    lo, hi = layout.tp_range(cfg.shared_intermediate_size)
    shared = {"latent expert input": x_in, "routed output": T * H * d,
              "shared experts": glu_bytes(cfg, T, hi - lo, d)}
    return max((router, routed, shared), key=lambda phase: sum(phase.values()))


def residual_bytes(cfg: ModelConfig, layout: ParallelLayout, step: Step) -> int:
    """Residual-stream tensors alive around a sublayer: the layer input, the normed input, the attention output
    and the running sum (two more with Block Attention Residuals: the mixed h and the partial sum), plus the
    fp32 all-reduce buffer and its cast when the sublayer is split."""
    per = step.tokens * cfg.hidden_size * step.dtype_bytes
    live = 5 if cfg.uses_attn_res else 4
    reduce = step.tokens * cfg.hidden_size * (FP32 + step.dtype_bytes) if layout.world > 1 else 0
    return live * per + reduce


def expert_stack_layer_bytes(cfg: ModelConfig, layout: ParallelLayout, dtype_bytes: int) -> int:
    """One MoE layer's dense experts on this rank stacked as [E, 2I, D] + [E, D, I]."""
    first, stop = layout.ep_range(cfg.num_experts)
    return (stop - first) * 3 * cfg.moe_intermediate_size * cfg.expert_in_dim * dtype_bytes


def expert_stack_bytes(cfg: ModelConfig, layout: ParallelLayout, dtype_bytes: int, experts: str) -> int:
    """The one-off transient of a MoE layer's first call on the grouped-GEMM path: its dense experts stacked
    (expert_stack_layer_bytes) while the per-expert tensors (bf16 experts, or the MXFP4 experts dequantized with
    experts="cached") are still alive (SparseMoE.stacked_weights); none for packed MXFP4 experts."""
    if not any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) or (cfg.experts_quantized
                                                                                and experts == "packed"):
        return 0
    return expert_stack_layer_bytes(cfg, layout, dtype_bytes)


def peak_transient(cfg: ModelConfig, layout: ParallelLayout, step: Step) -> tuple[int, str, dict[str, int]]:
    """(bytes, the sublayer kind where the peak is, its terms) for one prefill step on this rank."""
    local = local_config(cfg, layout)
    kinds: dict[str, dict[str, int]] = {}
    if cfg.has_kda:
        kinds["kda"] = kda_bytes(local, step)
    if cfg.has_mla:
        kinds["mla"] = mla_bytes(local, step)
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        lo, hi = layout.tp_range(cfg.intermediate_size)
        kinds["dense_mlp"] = {"gate up activation down": glu_bytes(cfg, step.tokens, hi - lo, step.dtype_bytes)}
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        kinds["moe"] = moe_bytes(cfg, layout, step)
    base = residual_bytes(cfg, layout, step)
    worst = max(kinds, key=lambda k: sum(kinds[k].values()))
    terms = {"residual stream": base, **kinds[worst]}
    return sum(terms.values()), worst, terms


def kind_totals(cfg: ModelConfig, layout: ParallelLayout, step: Step) -> dict[str, int]:
    """Predicted bytes inside each sublayer kind (without the residual stream): what `--measure` compares."""
    local = local_config(cfg, layout)
    out: dict[str, int] = {}
    if cfg.has_kda:
        out["kda"] = sum(kda_bytes(local, step).values())
    if cfg.has_mla:
        out["mla"] = sum(mla_bytes(local, step).values())
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        lo, hi = layout.tp_range(cfg.intermediate_size)
        out["dense_mlp"] = glu_bytes(cfg, step.tokens, hi - lo, step.dtype_bytes)
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        out["moe"] = sum(moe_bytes(cfg, layout, step).values())
    return out
