"""`k3verify bench --mxfp4`: MXFP4 experts served packed (codes + E8M0 scales decoded inside the Triton
grouped GEMM) against the same experts dequantized to bf16 (the reference mode), same weights and inputs.

Order of a run: weights (name-seeded, on the GPU) -> an fp32 gold on the torch paths (information only)
-> both bf16 models (weights memory of each, seconds per build stage) -> parity in this run (packed vs
dequantized prefill and teacher-forced decode logits, routes pinned, bars from the dequantized model's own
grouped-GEMM-vs-loop noise: bench/mxfp4_parity.py; graph replay == eager, bit for bit) -> speeds: the
routed-expert MoE of one layer at a few tokens (CUDA-graph replays) against the packed bandwidth floor,
decode tok/s per batch, prefill tok/s. Speeds only when every parity result passed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from k3verify.bench.floor import decode_floor_bytes, expert_bytes
from k3verify.bench.speeds import generate_ours, measured_distinct_experts
from k3verify.bench.timing import cuda_time, random_prompt, synchronize
from k3verify.config import ModelConfig
from k3verify.gates.shared.builders import torch_path
from k3verify.kernels.moe.grouped import moe_grouped_combine, moe_packed_combine
from k3verify.kernels.registry import REGISTRY
from k3verify.serving.batch import PackedBatch
from k3verify.serving.graphs import GraphDecoder, cuda_graph_recorder
from k3verify.serving.layers.moe import SparseMoE
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner

MODES = {"packed": "packed", "dequantized": "cached"}  # row name -> mxfp4_mode


@dataclass(frozen=True)
class Mxfp4Plan:
    preset: str = "k3-slice-4l"
    prefill_lens: tuple[int, ...] = (8192,)
    batches: tuple[int, ...] = (1, 64)
    moe_tokens: tuple[int, ...] = (1, 64)
    new_tokens: int = 64
    prompt_len: int = 128
    seed: int = 0
    parity_len: int = 128
    graph_parity_steps: int = 4
    decode_parity_steps: int = 8


@dataclass
class Mxfp4Result:
    preset: str
    device_name: str
    copy_bandwidth_GBps: float
    memory: dict[str, dict[str, float | None]] = field(default_factory=dict)
    build_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # mode -> load / stack / warmup
    parity: list[dict[str, Any]] = field(default_factory=list)
    moe_layer: list[dict[str, Any]] = field(default_factory=list)
    decode: list[dict[str, Any]] = field(default_factory=list)
    prefill: list[dict[str, Any]] = field(default_factory=list)
    kernel_fallbacks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    speeds_reported: bool = False
    kind: str = "mxfp4"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def torch_paths() -> contextlib.AbstractContextManager[None]:
    """Every registry op on its torch reference (the gold's kernels: no Triton, no fla)."""
    return torch_path(*REGISTRY.ops())


def held_expert_bytes(model: ServingModel, dense_only: bool = False) -> int:
    """Bytes of the distinct storages behind every routed expert tensor the model holds: checkpoint buffers,
    packed stacks, dequantized caches and bf16 stacks alike (`dense_only`: the floating-point ones)."""
    tensors: list[torch.Tensor] = []
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        tensors += [*moe.experts.buffers(), *moe.experts.parameters()]
        tensors += list(moe._stacked or ()) + [w for ws in moe._dense or () for w in ws]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if t.numel() and (t.is_floating_point() or not dense_only)}
    return sum(storages.values())


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def build_model(cfg: ModelConfig, tensors: Any, mode: str, device: torch.device,
                log: Callable[[str], None] = lambda _msg: None) -> tuple[ServingModel, dict[str, float | None],
                                                                      dict[str, float]]:
    """A bf16 ServingModel in `mode`, its experts stacked (packed: codes + scales; cached: dequantized to bf16)
    and warmed by one 16-token prefill, with what it holds (expert bytes; on CUDA every byte it allocated)
    and the seconds of each stage: load, stack, warm-up. The first model built in a process pays the warm-up
    prefill's Triton compiles and fla autotuning (cold machine); the stage times say so."""
    before = _allocated(device)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    model = ServingModel(cfg, torch.bfloat16, device, mode).load(tensors)
    synchronize()
    seconds["load"], t0 = time.perf_counter() - t0, time.perf_counter()
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for moe in moes:
        if moe.is_packed:
            moe.packed_experts()
        else:
            moe.stacked_weights()
    synchronize()
    seconds["stack"], t0 = time.perf_counter() - t0, time.perf_counter()
    model.prefill(PackedBatch.build(random_prompt(1, 16, cfg.vocab_size, 1, device)[0], [16], device=device))
    synchronize()
    seconds["warmup"] = time.perf_counter() - t0
    log(f"  {mode}: load {seconds['load']:.1f} s, {len(moes)} MoE layer(s) stacked in {seconds['stack']:.1f} s, "
        f"16-token warm-up prefill {seconds['warmup']:.1f} s (Triton compiles and fla autotuning, when cold)")
    after = _allocated(device)
    total = None if before is None or after is None else float(after - before)
    return model, {"expert_bytes": float(held_expert_bytes(model)), "model_bytes": total,
                   "bf16_expert_bytes": float(held_expert_bytes(model, dense_only=True))}, seconds


def gold_logits(cfg: ModelConfig, tensors: Any, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """fp32 logits of every position, dequantized experts, every op on its torch reference."""
    with torch_paths():
        model = ServingModel(cfg, torch.float32, device, "cached").load(tensors)
        out = model.prefill(PackedBatch.build(ids, [ids.numel()], device=device), all_logits=True).all_logits
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if out is None:
        raise RuntimeError("the gold prefill returned no per-position logits")
    return out


def graph_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds of `fn` replayed from a CUDA graph (no launch overhead), or wall clock off CUDA."""
    if device.type != "cuda":
        return cuda_time(fn, warmup=1, repeats=3).median_s
    graph, _ = cuda_graph_recorder(fn)
    return cuda_time(graph.replay, warmup=3, repeats=20).median_s


def time_moe_layer(packed: ServingModel, dense: ServingModel, tokens: int, bandwidth: float,
                   seed: int) -> dict[str, Any]:
    """The routed experts of the first MoE layer (sort, gate|up GEMM, activation, down GEMM, weighted sum)
    for `tokens` tokens routed by the layer's own router: packed vs dequantized, against the bytes the
    touched experts hold packed."""
    cfg, device = packed.cfg, packed.device
    moe_p = next(m for m in packed.modules() if isinstance(m, SparseMoE))
    moe_d = next(m for m in dense.modules() if isinstance(m, SparseMoE))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden_size, generator=g).bfloat16().to(device)
    with torch.no_grad():
        weights, idx = moe_p.gate(x)
        x_in = moe_p.routed_expert_down_proj(x) if moe_p.latent else x
        experts, (w13, w2) = moe_p.packed_experts(), moe_d.stacked_weights()
        packed_s = graph_seconds(lambda: moe_packed_combine(x_in, experts, weights, idx, moe_p.act), device)
        dense_s = graph_seconds(lambda: moe_grouped_combine(x_in, w13, w2, weights, idx, moe_d.act), device)
    touched = int(idx.unique().numel())
    floor_s = touched * expert_bytes(cfg, packed=True) / bandwidth
    return {"tokens": tokens, "distinct_experts": touched, "packed_us": packed_s * 1e6, "dequantized_us": dense_s * 1e6,
            "floor_us": floor_s * 1e6, "fraction_of_floor": floor_s / packed_s,
            "dequantized_fraction_of_packed_floor": floor_s / dense_s}


def time_decode(cfg: ModelConfig, runners: dict[str, ModelRunner], graphs: Mapping[str, GraphDecoder | None], B: int,
                plan: Mxfp4Plan, bandwidth: float) -> dict[str, Any]:
    """tok/s of `generate` (prefill included) and the median decode step per mode; % of the packed floor."""
    prompts = random_prompt(B, plan.prompt_len, cfg.vocab_size, plan.seed + 100 + B, runners["packed"].model.device)
    row: dict[str, Any] = {"batch": B}
    for name, runner in runners.items():
        generate_ours(runner, graphs[name], prompts, plan.new_tokens)  # warm-up (captures this bucket)
        spans: list[float] = []  # device time after the prefill, per generate

        def generate(r: ModelRunner = runner, g: GraphDecoder | None = graphs[name],
                     spans: list[float] = spans) -> object:
            return generate_ours(r, g, prompts, plan.new_tokens, spans)

        t = cuda_time(generate, warmup=0, repeats=2)
        row[f"{name}_tok_s"] = B * plan.new_tokens / t.median_s
        row[f"{name}_step_ms"] = sorted(spans)[len(spans) // 2] / max(plan.new_tokens - 1, 1) * 1e3
    touched = measured_distinct_experts(runners["packed"], prompts)
    for name, packed in (("packed", True), ("dequantized", False)):
        floor = decode_floor_bytes(cfg, B, plan.prompt_len + plan.new_tokens, distinct_experts=touched,
                                   packed_experts=packed)
        row[f"{name}_floor_step_ms"] = floor.total / bandwidth * 1e3
    row["distinct_experts_per_layer"] = touched
    row["fraction_of_packed_floor"] = row["packed_floor_step_ms"] / row["packed_step_ms"]
    return row


def time_prefill(models: dict[str, ServingModel], T: int, seed: int) -> dict[str, Any]:
    any_model = models["packed"]
    ids = random_prompt(1, T, any_model.cfg.vocab_size, seed + T, any_model.device)[0]
    pack = PackedBatch.build(ids, [T], device=any_model.device)
    row: dict[str, Any] = {"tokens": T}
    for name, model in models.items():
        def prefill(m: ServingModel = model) -> object:
            return m.prefill(pack)

        row[f"{name}_tok_s"] = T / cuda_time(prefill, warmup=1, repeats=3).median_s
    return row
