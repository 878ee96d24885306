"""The `k3verify bench --mxfp4` run (measurements in bench/mxfp4.py) and its table."""

from __future__ import annotations

from typing import Any

import torch

from k3verify.bench import mxfp4 as m
from k3verify.bench.parity import decode_parity, graph_parity
from k3verify.bench.run import progress
from k3verify.bench.timing import random_prompt
from k3verify.config import ModelConfig
from k3verify.kernels.registry import REGISTRY
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.runner import ModelRunner


def run_mxfp4_bench(plan: m.Mxfp4Plan, cfg: ModelConfig, device: torch.device, bandwidth: float) -> m.Mxfp4Result:
    """Both models from the same name-seeded weights, gated by parity in this run, then timed (if green)."""
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors

    if not cfg.experts_quantized:
        raise ValueError(f"preset {plan.preset} has dense experts: the MXFP4 bench needs quantized ones")
    name = torch.cuda.get_device_name() if device.type == "cuda" else str(device)
    result = m.Mxfp4Result(plan.preset, name, bandwidth / 1e9)
    progress(f"generating {plan.preset} weights on {device}")
    tensors = synthetic_tensors(cfg, plan.seed, device=device)
    ids = random_prompt(1, plan.parity_len, cfg.vocab_size, plan.seed + 7, device)[0]
    progress("fp32 gold (dequantized experts, torch paths)")
    gold = m.gold_logits(cfg, tensors, ids, device)
    models = {}
    for row, mode in m.MODES.items():
        progress(f"building the {row} model (mxfp4_mode={mode!r})")
        models[row], result.memory[row] = m.build_model(cfg, tensors, mode, device)
    del tensors
    ctx = max(plan.prompt_len + plan.new_tokens + plan.graph_parity_steps + 8, plan.parity_len + 8)
    use_graphs = device.type == "cuda"
    runners, graphs = {}, {}
    for row, model in models.items():
        runners[row] = ModelRunner(model, num_pages=max(plan.batches) * (-(-ctx // 64)) + 8, page_size=64,
                                   num_slots=max(plan.batches) + 1, max_context=max(ctx, *plan.prefill_lens))
        graphs[row] = GraphDecoder(model, ctx, buckets=tuple(sorted(set(plan.batches))), use_graphs=use_graphs)

    progress("parity")
    theirs = models["dequantized"].prefill(_pack(ids), all_logits=True).all_logits
    if theirs is None:
        raise RuntimeError("the dequantized prefill returned no per-position logits")
    result.parity.append(m.prefill_parity(models["packed"], gold, theirs, ids, plan.parity_bar))
    S = plan.decode_parity_steps
    result.parity.append(decode_parity(runners["packed"], graphs["packed"], ids, gold, theirs,
                                       plan.parity_len - S, S, plan.parity_bar))
    result.parity[-1]["id"] = "bench.mxfp4.decode_logits_vs_fp32_gold"
    if use_graphs:
        for B in sorted(set(plan.batches)):
            prompts = random_prompt(B, plan.prompt_len, cfg.vocab_size, plan.seed + B, device)
            result.parity.append(graph_parity(runners["packed"], graphs["packed"], prompts, plan.graph_parity_steps))
    if not all(r["status"] == "pass" for r in result.parity):
        result.notes.append("parity is not green in this run: speeds withheld")
        return _with_fallbacks(result)
    for T in plan.moe_tokens:
        progress(f"MoE layer, {T} token(s)")
        result.moe_layer.append(m.time_moe_layer(models["packed"], models["dequantized"], T, bandwidth,
                                                 plan.seed + T))
    for B in plan.batches:
        progress(f"decode batch {B}")
        result.decode.append(m.time_decode(cfg, runners, graphs, B, plan, bandwidth))
    for T in plan.prefill_lens:
        progress(f"prefill {T}")
        result.prefill.append(m.time_prefill(models, T, plan.seed))
    result.speeds_reported = True
    progress("done")
    return _with_fallbacks(result)


def _pack(ids: torch.Tensor) -> Any:
    from k3verify.serving.batch import PackedBatch

    return PackedBatch.build(ids, [ids.numel()], device=ids.device)


def _with_fallbacks(result: m.Mxfp4Result) -> m.Mxfp4Result:
    result.kernel_fallbacks = sorted({f"{op}: {reason}" for op, reason in REGISTRY.fallbacks})
    return result


def _gb(n: float | None) -> str:
    if n is None:
        return "–"
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def mxfp4_table(data: dict[str, Any]) -> str:
    """Weights memory, MoE layer, decode and prefill rows: packed vs dequantized, % of the packed floor."""
    hw = f"{data['device_name']} (copy {data['copy_bandwidth_GBps']:,.0f} GB/s)"
    mem = data["memory"]
    rows = [f"{data['preset']} on {hw}: MXFP4 experts packed vs dequantized to bf16",
            "| workload | packed | dequantized | ratio | packed floor | % of packed floor |",
            "|---|---|---|---|---|---|"]
    memory_rows = (("experts held", "expert_bytes", "expert_bytes"),
                   ("experts as multiplied (codes + scales vs bf16)", "expert_bytes", "bf16_expert_bytes"),
                   ("whole model, allocated on the GPU", "model_bytes", "model_bytes"))
    for label, packed_key, dense_key in memory_rows:
        p, d = mem["packed"][packed_key], mem["dequantized"][dense_key]
        ratio = f"{d / p:.2f}x smaller" if p and d else "–"
        rows.append(f"| weights memory: {label} | {_gb(p)} | {_gb(d)} | {ratio} | – | – |")
    if not data.get("speeds_reported"):
        return "\n".join(rows) + "\n\nNo speeds: " + "; ".join(data.get("notes", ["parity not green"]))
    for r in data["moe_layer"]:
        rows.append(f"| MoE layer (routed experts), {r['tokens']} token(s), {r['distinct_experts']} experts | "
                    f"{r['packed_us']:,.1f} us | {r['dequantized_us']:,.1f} us | "
                    f"{r['dequantized_us'] / r['packed_us']:.2f}x | {r['floor_us']:,.1f} us | "
                    f"{100 * r['fraction_of_floor']:.0f}% |")
    for r in data["decode"]:
        rows.append(f"| decode batch {r['batch']} | {r['packed_tok_s']:,.0f} tok/s ({r['packed_step_ms']:.2f} ms) | "
                    f"{r['dequantized_tok_s']:,.0f} tok/s ({r['dequantized_step_ms']:.2f} ms) | "
                    f"{r['packed_tok_s'] / r['dequantized_tok_s']:.2f}x | {r['packed_floor_step_ms']:.2f} ms | "
                    f"{100 * r['fraction_of_packed_floor']:.0f}% |")
    for r in data["prefill"]:
        ratio = r["packed_tok_s"] / r["dequantized_tok_s"]
        rows.append(f"| prefill {r['tokens']:,} tokens | {r['packed_tok_s']:,.0f} tok/s | "
                    f"{r['dequantized_tok_s']:,.0f} tok/s | {ratio:.2f}x | – | – |")
    passed = ", ".join(f"{p['id']} {p['status']}" for p in data["parity"])
    return "\n".join(rows) + f"\n\nParity in the same run: {passed}."
