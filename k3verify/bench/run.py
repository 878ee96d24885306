"""`k3verify bench`: our prefill, decode and served speed against a baseline, same weights and inputs.

Order of a run: weights (name-seeded, generated on the device) -> an fp32 gold and a bf16 baseline on the
same weights (transformers+fla for Kimi-Linear; for K3, which transformers lacks, the K3 reference itself in
fp32 and bf16) -> our model -> parity in this run (our prefill and graph-decode logits vs the gold, graph
replay vs the same step eager, the served path's tokens vs the bench path's) -> speeds (prefill, decode,
served under concurrent streaming clients) -> a decode profile. A speed is reported only when every parity
result of the run passed; otherwise the speeds are withheld and the command exits 1.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from k3verify.bench.floor import measure_copy_bandwidth
from k3verify.bench.profile import profile_decode, profile_prefill
from k3verify.bench.speed_parity import (
    decode_parity,
    gold_logits,
    graph_parity,
    model_parity,
    prefill_graph_parity,
)
from k3verify.bench.speeds import runner_prefill, time_decode, time_prefill
from k3verify.bench.timing import random_prompt
from k3verify.config import ModelConfig
from k3verify.oracle.hf_model import load_baseline
from k3verify.serving.batch import PackedBatch
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.prefill_graphs import GraphPrefill
from k3verify.serving.runner import ModelRunner


@dataclass
class BenchResult:
    preset: str
    device_name: str
    copy_bandwidth_GBps: float
    baseline_name: str = "transformers+fla"
    parity: list[dict[str, Any]] = field(default_factory=list)
    prefill: list[dict[str, Any]] = field(default_factory=list)
    decode: list[dict[str, Any]] = field(default_factory=list)
    served: list[dict[str, Any]] = field(default_factory=list)
    profile: list[dict[str, Any]] = field(default_factory=list)
    profile_prefill: list[dict[str, Any]] = field(default_factory=list)
    kernel_fallbacks: list[str] = field(default_factory=list)  # every (op: reason) a fast path refused
    moe_paths: dict[str, int] = field(default_factory=dict)  # bf16 MoE combine calls per kernel path, whole run
    notes: list[str] = field(default_factory=list)
    speeds_reported: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BenchPlan:
    preset: str
    prefill_lens: tuple[int, ...] = (1024, 8192)
    batches: tuple[int, ...] = (1, 16, 64)
    new_tokens: int = 64
    prompt_len: int = 128
    seed: int = 0
    baseline: bool = True
    use_graphs: bool = True
    parity_bar: float = 5e-3
    parity_len: int = 256
    graph_parity_steps: int = 8
    decode_parity_steps: int = 16
    profile_batches: tuple[int, ...] = ()
    profile_prefill_lens: tuple[int, ...] = ()  # prefill lengths to profile (one sequence, eager)
    served_concurrency: tuple[int, ...] = ()  # () = no served phase; each must be a benchmarked batch
    served_requests_per_client: int = 3
    prefill_graphs: bool = False  # prefills of fresh prompts replayed from CUDA graphs (bench path and engine)
    card_gib: float | None = None  # the card's memory (None: read from the CUDA device; off CUDA nothing is checked)
    streamed_gold: bool | None = None  # the K3 reference streamed as the gold (None: where transformers fp32 fails)

    def __post_init__(self) -> None:
        extra = sorted(set(self.served_concurrency) - set(self.batches))
        if extra:
            raise ValueError(f"served concurrency {extra} is not a benchmarked batch {self.batches}: the served "
                             "parity compares with the bench path at the same batch")


@dataclass
class Setup:
    """What every phase of one run shares."""

    cfg: ModelConfig
    device: torch.device
    runner: ModelRunner
    graphs: GraphDecoder
    baseline: Any  # the bf16 baseline module (transformers) or None
    gold: torch.Tensor | None  # fp32 gold logits of parity_ids
    theirs: torch.Tensor | None  # the bf16 baseline's logits of parity_ids
    parity_ids: torch.Tensor
    prefill_graphs: GraphPrefill | None = None


_T0 = time.perf_counter()


def progress(msg: str) -> None:
    """One line per stage on stderr, so a run cut short still shows how far it got."""
    print(f"[bench +{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def setup(plan: BenchPlan, cfg: ModelConfig, hf_dict: dict[str, Any], device: torch.device,
          result: BenchResult) -> Setup:
    """Weights, the gold and baseline logits, our model, a runner and graphs sized for the workload."""
    from k3verify.bench.k3_gold import k3_gold_and_baseline
    from k3verify.bench.memory_fit import (
        LazySynthetic,
        bench_peak,
        fp32_whole_fits,
        require_bench_fits,
        streamed_gold_logits,
    )
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors
    from k3verify.kernels.compile_watch import watch_compiles
    from k3verify.plan.device_fit import device_memory_gib
    from k3verify.serving.model import ServingModel

    max_b = max(plan.batches)
    ctx = max(plan.prompt_len + plan.new_tokens + plan.graph_parity_steps + 8, 2 * plan.decode_parity_steps)
    card_gib = plan.card_gib if plan.card_gib is not None or device.type != "cuda" else device_memory_gib(device)
    if device.type == "cuda":
        watch_compiles()
    if card_gib is not None:  # say it before the allocator does
        require_bench_fits(bench_peak(cfg, context=max(ctx, *plan.prefill_lens, plan.parity_len), batch=max_b,
                                      segment=max(*plan.prefill_lens, plan.parity_len)),
                           card_gib)
    progress(f"generating {plan.preset} weights on {device}")
    tensors = synthetic_tensors(cfg, plan.seed, device=device)
    parity_ids = random_prompt(1, plan.parity_len, cfg.vocab_size, plan.seed + 7, device)[0]
    gold = theirs = hf = None
    if plan.baseline and cfg.is_k3:
        progress("fp32 gold and bf16 baseline: the K3 reference")
        result.baseline_name = "K3 reference (bf16)"
        result.notes.append("transformers has no K3: the gold is the K3 reference in fp32, the parity baseline the "
                            "same reference in bf16; speeds are compared with our own eager decode")
        gold, theirs = k3_gold_and_baseline(cfg, tensors, parity_ids, device)
    elif plan.baseline and (plan.streamed_gold if plan.streamed_gold is not None else
                            card_gib is not None and not fp32_whole_fits(cfg, card_gib)):
        progress("fp32 gold (the K3 reference, streamed) and bf16 baseline (transformers+fla)")
        gold, note = streamed_gold_logits(cfg, tensors, parity_ids, device)
        result.notes.append(note)
        hf = load_baseline(cfg, hf_dict, tensors, device)
        with torch.no_grad():
            theirs = hf(input_ids=parity_ids[None], use_cache=False).logits[0].float()
    elif plan.baseline:
        progress("fp32 gold (transformers+fla)")
        gold = gold_logits(cfg, hf_dict, tensors, parity_ids, device)
        hf = load_baseline(cfg, hf_dict, tensors, device)
        with torch.no_grad():
            theirs = hf(input_ids=parity_ids[None], use_cache=False).logits[0].float()
    progress("loading our model")
    del tensors  # our model reads the same values drawn again one tensor at a time: never beside all of them
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model = ServingModel(cfg, torch.bfloat16, device).load(LazySynthetic(cfg, plan.seed, device))
    page = 64
    runner = ModelRunner(model, num_pages=max_b * (-(-ctx // page)) + 8, page_size=page, num_slots=max_b + 1,
                         max_context=max(ctx, *plan.prefill_lens, plan.parity_len))
    # Decode attends over a static context padded to the graph's max_context: size it to the decode
    # workload (prompt + new tokens), not to the longest prefill, or every step reads dead latents.
    graphs = GraphDecoder(model, ctx, buckets=tuple(sorted(set(plan.batches))),
                          use_graphs=plan.use_graphs and device.type == "cuda")
    prefill_graphs = None
    if plan.prefill_graphs:
        if not plan.use_graphs:
            raise ValueError("prefill graphs run with the decode graphs only (the plan turns graphs off)")
        tokens = max(*plan.prefill_lens, plan.prompt_len * max(plan.batches))
        # off CUDA the static step runs without a graph: nothing replays, so the parity rows fail (the CPU dry run)
        prefill_graphs = GraphPrefill(model, max_tokens=tokens, max_seqs=2 * (max_b + 1),
                                      use_graphs=device.type == "cuda")
    return Setup(cfg, device, runner, graphs, hf, gold, theirs, parity_ids, prefill_graphs)


def bench_parity(plan: BenchPlan, s: Setup, result: BenchResult) -> bool:
    """The bench path's parity; True when a model-level comparison ran and everything passed."""
    progress("parity")
    if s.gold is not None and s.theirs is not None:
        result.parity.append(model_parity(s.runner, s.theirs, s.parity_ids, s.gold, plan.parity_bar))
    if s.graphs.use_graphs:
        for B in sorted(set(plan.batches)):
            prompts = random_prompt(B, plan.prompt_len, s.cfg.vocab_size, plan.seed + B, s.device)
            result.parity.append(graph_parity(s.runner, s.graphs, prompts, steps=plan.graph_parity_steps))
    if s.gold is not None and s.theirs is not None:
        S = plan.decode_parity_steps
        P = min(plan.parity_len, s.graphs.max_context) - S
        result.parity.append(decode_parity(s.runner, s.graphs, s.parity_ids, s.gold, s.theirs, P, S,
                                           plan.parity_bar))
    if s.prefill_graphs is not None:
        packs = [random_prompt(1, T, s.cfg.vocab_size, plan.seed + 600 + T, s.device).tolist()
                 for T in plan.prefill_lens]
        packs += [random_prompt(B, plan.prompt_len, s.cfg.vocab_size, plan.seed + 700 + B, s.device).tolist()
                  for B in sorted(set(plan.served_concurrency or plan.batches))]
        result.parity += prefill_graph_parity(s.runner, s.prefill_graphs, packs, plan.parity_bar)
    model_level = any(r["id"].startswith("bench.prefill_logits") for r in result.parity)
    if not model_level:
        result.notes.append("no model-level parity ran (--no-baseline): graph-vs-eager alone proves nothing about "
                            "the model, so speeds are withheld")
    return model_level and all(r["status"] == "pass" for r in result.parity)


def bench_speeds(plan: BenchPlan, s: Setup, result: BenchResult, bandwidth: float) -> None:
    hf = s.baseline
    for T in plan.prefill_lens:
        progress(f"prefill {T}")
        ids = random_prompt(1, T, s.cfg.vocab_size, plan.seed + T, s.device)
        pack = PackedBatch.build(ids[0], [T], device=s.device)

        def eager(pack: PackedBatch = pack) -> object:
            return s.runner.model.prefill(pack)

        theirs = None if hf is None else (lambda ids=ids: hf(input_ids=ids, use_cache=False))
        if s.prefill_graphs is None:
            result.prefill.append(time_prefill(eager, theirs, T) | {"ours_path": "eager"})
            continue
        # the served prefill: one fresh sequence admitted, prefilled through the graphs, released
        replays = s.prefill_graphs.replays
        prompt = ids.tolist()  # on the host once, outside the timed calls
        row = time_prefill(lambda prompt=prompt: runner_prefill(s.runner, prompt, s.prefill_graphs), theirs, T)
        graphed = s.prefill_graphs.replays - replays
        row |= {"ours_path": "graph" if graphed >= row["rounds"] else f"eager ({graphed} replays)",
                "ours_eager_tok_s": time_prefill(eager, None, T)["ours_tok_s"]}
        result.prefill.append(row)
    for B in plan.batches:
        progress(f"decode batch {B}")
        result.decode.append(time_decode(s.cfg, s.runner, s.graphs if s.graphs.use_graphs else None, s.baseline, B,
                                         plan.prompt_len, plan.new_tokens, bandwidth, plan.seed + 100 + B,
                                         compare_eager=s.baseline is None, prefill_graphs=s.prefill_graphs))


def _graph_counts(graphs: GraphPrefill | None) -> dict[str, int]:
    if graphs is None:
        return {}
    return {"captures": graphs.captures, "replays": graphs.replays, "borrowed": graphs.borrowed,
            "evictions": graphs.evictions,
            "bucketed_eager": sum(graphs.sightings.values()) - graphs.replays}


def run_bench(plan: BenchPlan, cfg: ModelConfig, hf_dict: dict[str, Any], device: torch.device,
              bandwidth: float) -> BenchResult:
    """Build the models on `device` from the same name-seeded weights, gate, then time (if green)."""
    from k3verify.bench import served as sv

    name = torch.cuda.get_device_name() if device.type == "cuda" else str(device)
    result = BenchResult(plan.preset, name, bandwidth / 1e9)
    s = setup(plan, cfg, hf_dict, device, result)
    green = bench_parity(plan, s, result)
    engine_graphs = None
    if green and plan.served_concurrency:
        progress("served parity (engine + HTTP, held waves)")
        engine_graphs = sv.engine_graphs(s.runner, s.graphs, plan.served_concurrency)
        with sv.served_stack(s.runner, engine_graphs, max(plan.served_concurrency), sv.step_budget(plan),
                             prefill_graphs=s.prefill_graphs) as stack:
            for c in plan.served_concurrency:
                result.parity.append(sv.served_parity(stack, s.runner, s.graphs, c, plan.prompt_len,
                                                      plan.new_tokens, plan.seed + 300 + c, s.prefill_graphs))
        green = all(r["status"] == "pass" for r in result.parity)
    if not green:
        result.notes.append("parity is not green (or did not run) in this run: speeds withheld")
        return _with_fallbacks(result)
    bench_speeds(plan, s, result, bandwidth)
    if engine_graphs is not None:
        with sv.served_stack(s.runner, engine_graphs, max(plan.served_concurrency), sv.step_budget(plan),
                             prefill_graphs=s.prefill_graphs) as stack:
            for c in plan.served_concurrency:
                progress(f"served, {c} concurrent streaming clients")
                before = _graph_counts(s.prefill_graphs)
                row = sv.served_speed(stack, s.cfg.vocab_size, c, plan.served_requests_per_client, plan.prompt_len,
                                      plan.new_tokens, plan.seed + 400 + c, s.device)
                if s.prefill_graphs is not None:  # what the run's prefills cost in captures (a capture stalls a step)
                    row["prefill_graphs"] = {k: v - before[k] for k, v in _graph_counts(s.prefill_graphs).items()}
                result.served.append(sv.beside_bench_path(row, result.decode))
    result.speeds_reported = True
    for B in plan.profile_batches:
        progress(f"profile decode batch {B}")
        prompts = random_prompt(B, plan.prompt_len, cfg.vocab_size, plan.seed + 200 + B, device)
        result.profile.append(profile_decode(s.runner, s.graphs, prompts))
    for T in plan.profile_prefill_lens:
        progress(f"profile prefill {T}")
        result.profile_prefill.append(profile_prefill(s.runner, T, cfg.vocab_size, plan.seed + 500 + T))
    progress("done")
    return _with_fallbacks(result)


def _with_fallbacks(result: BenchResult) -> BenchResult:
    from k3verify.kernels.moe import grouped
    from k3verify.kernels.registry import REGISTRY

    result.kernel_fallbacks = sorted({f"{op}: {reason}" for op, reason in REGISTRY.fallbacks})
    result.moe_paths = dict(grouped.PATHS)
    return result


def measure_bandwidth() -> float:
    return measure_copy_bandwidth(torch.device("cuda"))
