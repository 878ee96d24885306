"""`k3verify bench --speculative controlled|ngram`: speculative decoding speed on our model, parity first.

Random-weight checkpoints make n-gram acceptance meaningless, so the `controlled` drafter proposes a known
greedy continuation with each draft token replaced by a different token with probability 1 - p: nominal
acceptance p = 0 / 0.5 / 0.8 per draft. The continuation is the speculative path's own (spec_ref.py: in bf16 a
score pass and a plain decode step can pick different argmaxes, after which the plain continuation is wrong
at every later draft), found untimed by iterating to a fixed point; each row records the iterations, whether
it converged, and the tokens equal to that reference and to plain decode. Measured acceptance is accepted /
proposed drafts (k per score); with a converged reference it is expected to be sum_{i=1..k} p^i / k
(`accept_expected`: 59% at nominal 80%, k=4), since greedy acceptance stops at the first corrupted draft.
Rows: plain greedy decode and speculative greedy decode (CUDA graphs for both) per batch and acceptance, tok/s
over the whole generate call, and the score cost of one KDA layer, unfused (three launches) vs fused (one),
at 1..8 rows. Speeds are reported only when every parity result of the run passed (spec_parity.py, plus
bench.run's prefill parity).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from k3verify.bench import spec_parity
from k3verify.bench.run import progress
from k3verify.bench.spec_ref import SpecReference, continuation_match, converge_reference, expected_acceptance
from k3verify.bench.speed_parity import gold_logits, model_parity
from k3verify.bench.speeds import DeviceMarks, generate_ours
from k3verify.bench.timing import cuda_time, random_prompt
from k3verify.config import ModelConfig
from k3verify.kernels.kda.score import SCORE_FUSED, kda_score
from k3verify.kernels.moe import grouped
from k3verify.kernels.registry import REGISTRY
from k3verify.oracle.hf_model import load_baseline
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner
from k3verify.serving.spec.drafter import ControlledDrafter, Drafter, NgramDrafter
from k3verify.serving.spec.offline import SpecRun, generate_speculative
from k3verify.serving.spec.policy import CostPolicy, SpecPolicy
from k3verify.serving.spec.score_graphs import ScoreGraphs
from k3verify.serving.spec.scorer import SpecScorer


@dataclass(frozen=True)
class SpecPlan:
    preset: str
    batches: tuple[int, ...] = (1, 16)
    num_draft: int = 4
    drafter: str = "controlled"  # or "ngram"
    accept: tuple[float, ...] = (0.0, 0.5, 0.8)  # controlled drafter: nominal acceptance per draft token
    new_tokens: int = 64
    prompt_len: int = 128
    seed: int = 0
    fused: bool = False  # --kda-fused-score for the speed rows
    baseline: bool = True  # model-level parity against transformers+fla's fp32 gold
    parity_bar: float = 5e-3
    parity_len: int = 256
    parity_chunks: int = 3
    kernel_rows: tuple[int, ...] = (1, 4, 8)
    layer_rows: tuple[int, ...] = (1, 2, 4, 8)
    min_mean_accepted: float = 0.25
    use_graphs: bool = True
    ref_iterations: int | None = None  # cap of the controlled drafter's reference iteration; None: new_tokens
    cost_policy: bool = True  # policy.CostPolicy in the speed rows, one per batch size across its runs (as in serve)


@dataclass
class SpecBenchResult:
    preset: str
    device_name: str
    kda_verify_path: str
    num_draft: int
    parity: list[dict[str, Any]] = field(default_factory=list)
    speed: list[dict[str, Any]] = field(default_factory=list)
    layer_cost: list[dict[str, Any]] = field(default_factory=list)
    kernel_fallbacks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    speeds_reported: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"spec": True, **asdict(self)}


def _timed(fn: Any, spans: list[float]) -> tuple[Any, float, float]:
    """Run fn once as warm-up (captures, compiles), then twice timed; (last result, median seconds, median of the
    decode-phase seconds fn appended to `spans` in the timed calls)."""
    out: list[Any] = [fn()]
    spans.clear()  # the warm-up's
    t = cuda_time(lambda: out.append(fn()), warmup=0, repeats=2)
    return out[-1], t.median_s, statistics.median(spans)


def speed_rows(plan: SpecPlan, scorer: SpecScorer, vgraphs: ScoreGraphs | None, dgraphs: GraphDecoder | None,
               B: int) -> list[dict[str, Any]]:
    """Plain greedy decode, then speculative greedy decode per acceptance, on the same prompts. The controlled
    drafter follows the speculative path's own continuation, iterated to a fixed point untimed (spec_ref.py)."""
    runner, cfg = scorer.runner, scorer.runner.model.cfg
    prompt_ids = random_prompt(B, plan.prompt_len, cfg.vocab_size, plan.seed + 300 + B, runner.model.device)
    prompts = prompt_ids.tolist()
    plain_spans: list[float] = []
    plain, plain_s, plain_decode_s = _timed(
        lambda: generate_ours(runner, dgraphs, prompt_ids, plan.new_tokens, plain_spans).tolist(), plain_spans)
    plain_refs = {i: p + o for i, (p, o) in enumerate(zip(prompts, plain, strict=True))}
    tokens = B * plan.new_tokens
    rows = []
    cost_policy = CostPolicy() if plan.cost_policy else None
    for accept in plan.accept if plan.drafter == "controlled" else (float("nan"),):
        def generate(drafter: Drafter, spans: list[float] | None = None) -> SpecRun:
            marks = DeviceMarks(runner.device)
            run = generate_speculative(scorer, drafter, prompts, plan.new_tokens,
                                       policy=SpecPolicy(min_mean_accepted=plan.min_mean_accepted),
                                       score_graphs=vgraphs, decode_graphs=dgraphs, after_prefill=marks.mark,
                                       cost_policy=cost_policy)
            marks.mark()
            if spans is not None:
                spans.append(marks.seconds(0, 1))
            return run

        def controlled(refs: dict[int, list[int]], accept: float = accept) -> ControlledDrafter:
            return ControlledDrafter(plan.num_draft, refs, 1.0 - accept, cfg.vocab_size, plan.seed)

        ref = None
        if plan.drafter == "controlled":
            cap = plan.new_tokens if plan.ref_iterations is None else plan.ref_iterations
            ref = converge_reference(lambda refs: generate(controlled(refs)).tokens, prompts, plain_refs, cap)
            progress(f"batch {B} nominal {accept:.0%}: reference {'converged' if ref.converged else 'NOT converged'} "
                     f"after {ref.iterations} untimed runs")
        drafter: Drafter = NgramDrafter(plan.num_draft) if ref is None else controlled(ref.references)
        paths = grouped.PATHS.copy()
        spec_spans: list[float] = []
        run, spec_s, spec_decode_s = _timed(lambda d=drafter, s=spec_spans: generate(d, s), spec_spans)
        row = {"batch": B, "drafter": plan.drafter, "accept_nominal": accept, "accept_measured": run.acceptance,
               "plain_tok_s": tokens / plain_s, "spec_tok_s": tokens / spec_s, "speedup": plain_s / spec_s,
               # the decode phase alone (after the prefill's work is issued, both sides): the whole call holds a
               # host-bound prefill that neither side's decoding changes
               "decode_speedup": plain_decode_s / spec_decode_s, "plain_decode_ms": 1e3 * plain_decode_s,
               "spec_decode_ms": 1e3 * spec_decode_s,
               "verify_steps": run.score_steps, "decode_steps": run.decode_steps,
               "turned_off": sum(s.off for s in run.stats), "rider_rows": run.rider_rows,
               "cost_gate": None if cost_policy is None else cost_policy.describe() | {"gated_off": run.cost_off},
               "tokens_equal_to_plain": continuation_match(run.tokens, prompts, plain_refs),
               "moe_paths": dict(grouped.PATHS - paths)}  # the timed run's bf16 MoE combine calls per kernel path
        rows.append(row if ref is None else row | _reference_columns(ref, run, prompts, accept, plan.num_draft))
    return rows


def _reference_columns(ref: SpecReference, run: SpecRun, prompts: list[list[int]], accept: float,
                       num_draft: int) -> dict[str, Any]:
    cols: dict[str, Any] = {"accept_expected": expected_acceptance(accept, num_draft),
                            "ref_iterations": ref.iterations, "ref_converged": ref.converged,
                            "tokens_equal_to_reference": continuation_match(run.tokens, prompts, ref.references)}
    if not ref.converged:
        cols["note"] = (f"the drafter's reference did not converge in {ref.iterations} iterations: its drafts are not "
                        f"the speculative path's own continuation, so this row does not measure nominal {accept:.0%}")
    return cols


def layer_cost(cfg: ModelConfig, device: torch.device, rows: int, num_draft: int, seed: int,
               calls: int = 20) -> dict[str, Any]:
    """Microseconds per KDA-layer score (one layer's dims, bf16), unfused vs fused, each as `calls` back-to-back
    calls in one CUDA graph (launch gaps of a real step, no host): median of 5 replays / calls."""
    from k3verify.gates.shared.spec_cases import op_case

    case = op_case(SimpleNamespace(cfg=cfg, device=device, generator=torch.Generator().manual_seed(seed)),
                   torch.bfloat16, rows=rows, num_draft=num_draft)
    B, n, h, dk = case.shape
    conv_rec = torch.empty(B, n, 3, h * dk, cfg.conv_kernel_size - 1, device=device)
    state_rec = torch.empty(B, n, h, dk, dk, device=device)
    row: dict[str, Any] = {"rows": rows, "positions": n}
    for name, fused in (("unfused", False), ("fused", True)):
        def step(fused: bool = fused) -> object:
            return kda_score(case.xs, case.weights, case.windows, case.state, case.slots, case.keep, case.g,
                              case.beta, case.gate, case.norm_weight, case.eps, case.scale, conv_rec, state_rec,
                              fused=fused)
        step()  # compile, allocate the fused kernel's tickets
        fn: Any = step
        if device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    step()
            fn = graph.replay
        t = cuda_time(fn, warmup=2, repeats=5)
        row[f"{name}_us"] = t.median_s / (calls if device.type == "cuda" else 1) * 1e6
        if fused:
            row["fused_path"] = REGISTRY.last_backend.get(SCORE_FUSED, "none")
    row["fused_speedup"] = row["unfused_us"] / row["fused_us"]
    return row


def run_spec_bench(plan: SpecPlan, cfg: ModelConfig, hf_dict: dict[str, Any], device: torch.device) -> SpecBenchResult:
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors

    name = torch.cuda.get_device_name() if device.type == "cuda" else str(device)
    result = SpecBenchResult(plan.preset, name, "fused" if plan.fused else "unfused", plan.num_draft)
    n, max_b = plan.num_draft + 1, max(plan.batches)
    ctx = plan.prompt_len + plan.new_tokens + 2 * n + 8
    progress(f"generating {plan.preset} weights on {device}")
    tensors = synthetic_tensors(cfg, plan.seed, device=device)
    ids = random_prompt(1, plan.parity_len, cfg.vocab_size, plan.seed + 7, device)[0]
    gold = theirs = None
    if plan.baseline and not cfg.is_k3:
        progress("fp32 gold and bf16 baseline (transformers+fla)")
        gold = gold_logits(cfg, hf_dict, tensors, ids, device)
        hf = load_baseline(cfg, hf_dict, tensors, device)
        with torch.no_grad():
            theirs = hf(input_ids=ids[None], use_cache=False).logits[0].float()
        del hf
    model = ServingModel(cfg, torch.bfloat16, device).load(tensors)
    del tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()
    runner = ModelRunner(model, num_pages=max_b * (-(-max(ctx, plan.parity_len + n) // 64)) + 16, page_size=64,
                         num_slots=max_b + 1, max_context=max(ctx, plan.parity_len + n))
    graphs_on = plan.use_graphs and device.type == "cuda"
    buckets = tuple(sorted(set(plan.batches)))
    dgraphs = GraphDecoder(model, ctx, buckets=buckets, use_graphs=True) if graphs_on else None
    scorer = SpecScorer(runner, plan.num_draft, max_b, fused=plan.fused)
    vgraphs = scorer.make_graphs(ctx, buckets) if graphs_on else None
    _parity(plan, result, scorer, vgraphs, ids, gold, theirs, device)
    return _speeds(plan, result, scorer, vgraphs, dgraphs, device)


def _parity(plan: SpecPlan, result: SpecBenchResult, scorer: SpecScorer, vgraphs: ScoreGraphs | None,
            ids: torch.Tensor, gold: torch.Tensor | None, theirs: torch.Tensor | None, device: torch.device) -> None:
    progress("parity")
    cfg = scorer.runner.model.cfg
    if gold is not None and theirs is not None:
        result.parity.append(model_parity(scorer.runner, theirs, ids, gold, plan.parity_bar))
        # the parity pack runs eagerly: a graph bucket of one row sized to the decode context would not hold it
        result.parity.append(spec_parity.score_logits_parity(scorer, None, ids, gold, theirs, plan.parity_chunks,
                                                               plan.parity_bar))
    if device.type == "cuda" and cfg.has_kda:
        result.parity.append(spec_parity.fused_kernel_parity(cfg, device, plan.kernel_rows, plan.seed))
    if vgraphs is not None:
        for B in vgraphs.buckets:
            prompts = random_prompt(B, plan.prompt_len, cfg.vocab_size, plan.seed + 200 + B, device)
            result.parity.append(spec_parity.score_graph_parity(scorer, vgraphs, prompts))


def _speeds(plan: SpecPlan, result: SpecBenchResult, scorer: SpecScorer, vgraphs: ScoreGraphs | None,
            dgraphs: GraphDecoder | None, device: torch.device) -> SpecBenchResult:
    model_level = any(r["id"] == "bench.spec_verify_logits_vs_fp32_gold" for r in result.parity)
    if not model_level:
        result.notes.append("no model-level parity ran (it needs the transformers baseline, which has no K3 features): "
                            "speeds withheld")
    elif all(r["status"] == "pass" for r in result.parity):
        for B in plan.batches:
            progress(f"speculative decode batch {B}")
            result.speed.extend(speed_rows(plan, scorer, vgraphs, dgraphs, B))
        result.notes += [f"batch {r['batch']} nominal {r['accept_nominal']:.0%}: {r['note']}"
                         for r in result.speed if "note" in r]
        for rows in plan.layer_rows:
            progress(f"KDA layer score cost, {rows} rows")
            result.layer_cost.append(layer_cost(scorer.runner.model.cfg, device, rows, plan.num_draft, plan.seed))
        result.speeds_reported = True
    else:
        result.notes.append("parity is not green in this run: speeds withheld")
    fused = [f"{op}: {reason}" for op, reason in REGISTRY.fallbacks if op == SCORE_FUSED]
    if plan.fused:
        ran = REGISTRY.last_backend.get(SCORE_FUSED, "none")
        result.kda_verify_path = "fused" if ran == "triton" and not fused else f"unfused (fused refused: {fused})"
    result.kernel_fallbacks = sorted({f"{op}: {reason}" for op, reason in REGISTRY.fallbacks})
    progress("done")
    return result


def markdown_table(data: dict[str, Any]) -> str:
    """The README tables from the bench JSON; rows of a JSON written before the reference iteration (no
    accept_expected / ref_* / tokens_equal_to_reference) print with "-" and "plain (not iterated)"."""
    hw = data["device_name"]
    if not data.get("speeds_reported"):
        return (f"No speeds for {data['preset']} on {hw} (KDA score path: {data['kda_verify_path']}): "
                + "; ".join(data.get("notes", ["parity not green"])))
    rows = ["| hardware | workload | plain decode | speculative | speedup | decode phase: plain / speculative, "
            "speedup | acceptance measured / expected | drafter reference | tokens equal to reference / plain | "
            "score / decode steps, auto-off |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows += [_speed_line(hw, data, r) for r in data["speed"]]
    rows += ["", "| KDA layer score, rows x positions | unfused (3 launches) | fused (1 launch) | fused speedup |",
             "|---|---|---|---|"]
    for r in data["layer_cost"]:
        rows.append(f"| {r['rows']} x {r['positions']} | {r['unfused_us']:.1f} us | {r['fused_us']:.1f} us "
                    f"({r['fused_path']}) | {r['fused_speedup']:.2f}x |")
    passed = ", ".join(f"{p['id']} {p['status']}" for p in data["parity"])
    notes = "".join(f"\nNote: {n}" for n in data.get("notes", []))
    return "\n".join(rows) + f"\n\nKDA score path of the speed rows: {data['kda_verify_path']}. Parity in the " \
        f"same run: {passed}.{notes}"


def _speed_line(hw: str, data: dict[str, Any], r: dict[str, Any]) -> str:
    def pct(key: str, fmt: str = ".0%") -> str:
        return "-" if r.get(key) is None else format(r[key], fmt)

    phase = (f"{r['plain_decode_ms']:.1f} / {r['spec_decode_ms']:.1f} ms, {r['decode_speedup']:.2f}x"
             if "decode_speedup" in r else "- (older run)")
    if "ref_converged" in r:
        ref = (f"converged in {r['ref_iterations']}" if r["ref_converged"]
               else f"NOT converged in {r['ref_iterations']}: not nominal")
    else:
        ref = "plain (not iterated)" if r["drafter"] == "controlled" else "-"
    return (f"| {hw} | {data['preset']} batch {r['batch']}, k={data['num_draft']}, {r['drafter']} "
            f"{r['accept_nominal']:.0%} | {r['plain_tok_s']:,.0f} tok/s | {r['spec_tok_s']:,.0f} tok/s | "
            f"{r['speedup']:.2f}x | {phase} | {pct('accept_measured')} / {pct('accept_expected')} | {ref} | "
            f"{pct('tokens_equal_to_reference', '.2f')} / {pct('tokens_equal_to_plain', '.2f')} | "
            f"{r['verify_steps']} / {r['decode_steps']}, {r['turned_off']} off"
            f"{', ' + str(r['rider_rows']) + ' rider rows' if r.get('rider_rows') else ''}"
            f"{_cost_policy_text(r.get('cost_gate'), r['batch'])} |")


def _cost_policy_text(cost_policy: dict[str, Any] | None, batch: int) -> str:
    """', cost policy off after score x.x / decode y.y ms' when the cost policy stopped scoring in that run."""
    if not cost_policy:
        return ""
    v, d = cost_policy["verify_ms"].get(str(batch)), cost_policy["decode_ms"].get(str(batch))
    times = f" (score {v:.1f} / decode {d:.1f} ms)" if v is not None and d is not None else ""
    return f", cost policy {'off' if cost_policy['gated_off'] else 'on'}{times}"
