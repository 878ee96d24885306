"""The `k3verify bench --mxfp4` run (measurements in bench/mxfp4.py) and its table."""

from __future__ import annotations

from typing import Any

import torch

from k3verify.bench import mxfp4 as m
from k3verify.bench import mxfp4_parity as mp
from k3verify.bench.run import progress
from k3verify.bench.speed_parity import graph_parity
from k3verify.bench.timing import random_prompt
from k3verify.config import ModelConfig
from k3verify.kernels.registry import REGISTRY
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.model import ServingModel
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
    progress("fp32 gold (dequantized experts, torch paths; information only)")
    gold = m.gold_logits(cfg, tensors, ids, device)
    models = {}
    for row, mode in m.MODES.items():
        progress(f"building the {row} model (mxfp4_mode={mode!r})")
        models[row], result.memory[row], result.build_seconds[row] = m.build_model(cfg, tensors, mode, device,
                                                                                   progress)
    del tensors
    ctx = max(plan.prompt_len + plan.new_tokens + plan.graph_parity_steps + 8, plan.parity_len + 8)
    use_graphs = device.type == "cuda"
    runners, graphs = {}, {}
    for row, model in models.items():
        runners[row] = ModelRunner(model, num_pages=max(plan.batches) * (-(-ctx // 64)) + 8, page_size=64,
                                   num_slots=max(plan.batches) + 1, max_context=max(ctx, *plan.prefill_lens))
        graphs[row] = GraphDecoder(model, ctx, buckets=tuple(sorted(set(plan.batches))), use_graphs=use_graphs)
    progress("parity: packed vs dequantized (routes pinned, bars from grouped-vs-loop noise)")
    result.parity += _packed_parity(plan, models, runners, ids, gold, ctx)
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


def _packed_parity(plan: m.Mxfp4Plan, models: dict[str, ServingModel], runners: dict[str, ModelRunner],
                   ids: torch.Tensor, gold: torch.Tensor, ctx: int) -> list[dict[str, Any]]:
    """Prefill and teacher-forced decode logits, packed vs dequantized (bench/mxfp4_parity.py)."""
    P, S = plan.parity_len - plan.decode_parity_steps, plan.decode_parity_steps
    prefill = mp.packed_vs_dequantized(
        "bench.mxfp4.prefill_packed_vs_dequantized", models["dequantized"],
        mp.prefill_run(models["dequantized"], ids), models["packed"], mp.prefill_run(models["packed"], ids), gold,
        f"prefill of {ids.numel()} tokens, every position's logits")
    decode = mp.packed_vs_dequantized(
        "bench.mxfp4.decode_packed_vs_dequantized", models["dequantized"],
        mp.decode_run(runners["dequantized"], ids, P, S, ctx), models["packed"],
        mp.decode_run(runners["packed"], ids, P, S, ctx), gold[P - 1:P + S],
        f"prefill {P} tokens, then {S} teacher-forced decode steps through the graphs' static step run eagerly "
        "(replay == eager: bench.graph_replay_vs_eager.*); logits at positions P-1..P+S-1")
    return [prefill, decode]


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
        return "\n".join(rows) + _parity_lines(data) + "\nNo speeds: " + "; ".join(data.get("notes",
                                                                                          ["parity not green"]))
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
    return "\n".join(rows) + _parity_lines(data)


def _parity_lines(data: dict[str, Any]) -> str:
    """One line per parity result of the run (metric, bar, control; fp32-gold distances as information)."""
    lines = ["", "", "Parity in the same run (packed vs dequantized: routes pinned, bar from grouped-vs-loop noise):"]
    for p in data["parity"]:
        line = f"  {p['id']}: {p['status']} {p['metric']:.3g}"
        if p.get("bar") is not None:
            line += f" (bar {p['bar']:.3g}, noise {p.get('noise_grouped_vs_loop_rms', 0.0):.3g})"
        line += f", control {p['control_metric']:.3g}"
        if "packed_vs_fp32_gold_rms" in p:
            line += (f"; vs fp32 gold (info) packed {p['packed_vs_fp32_gold_rms']:.3g}, dequantized "
                     f"{p['dequantized_vs_fp32_gold_rms']:.3g}; pins {p.get('router.pinned', 0):.0f}/"
                     f"{p.get('router.flips', 0):.0f}")
        lines.append(line)
    build = data.get("build_seconds", {})
    if build:
        lines.append("Build seconds (load / stack / 16-token warm-up): " + "; ".join(
            f"{mode} {s['load']:.1f} / {s['stack']:.1f} / {s['warmup']:.1f}" for mode, s in build.items()))
    return "\n".join(lines)
