"""Does the rounding near-tie excuse ever hide a fault? An injection sweep of the endpoint logprob checks.

The "endpoint" is the project's own whole-model oracle at fp32 computing in an emulated precision (w4a8-q8act by
default) with one fault injected: a weight scaled, one weight block doubled, a Q8_0 quantizer variant; or one
of the correct variants a real implementation may be (one ulp of noise per matmul, the reciprocal-scale
quantizer, correctly rounded dot products). Its greedy answers with top-k logprobs are handed to
endpoint.logprobs.topk as if a server had sent them, and the check is judged twice: with the near-tie excuse and
with it switched off. A fault must FAIL both ways (or, where it passes without the excuse, it is below what the
check can see); a correct variant must PASS.

    python -m tools.excuse_sweep                  # the whole sweep (k3-tp4, 5 prompt sets): a markdown table
    python -m tools.excuse_sweep --quick          # one prompt set, the smallest fault of each kind
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from k3verify.endpoint.wire import Answer, Step
from k3verify.gates.checks.endpoint.tokens import check_topk_logprobs
from k3verify.gates.core.check import REGISTRY, CheckContext, Result
from k3verify.gates.core.evaluate import evaluate_trial
from k3verify.gates.shared import endpoint_oracle as eo
from k3verify.gates.shared.endpoint_common import TOP_K, Greedy
from k3verify.oracle import functional as Fn
from k3verify.oracle.k3_reference import K3Reference
from k3verify.oracle.precision import get_precision
from k3verify.target import Target, resolve_target

LENGTHS = (5, 17, 40)  # the quick suite's prompt lengths (endpoint_common.QUICK)
NEW_TOKENS = 8
ROUTED = "model.layers.1.block_sparse_moe.experts.0.w3.weight"  # a routed-expert weight MoE layer 1 uses
PASSED = ("pass", "excused")  # "excused": a pass with rounding near-ties excused (gates/core/excused.py)
MLA = "model.layers.2.self_attn.o_proj.weight"  # an MLA weight (layers 2 and 5 are MLA on k3-tp4)


Patch = Callable[[], contextlib.AbstractContextManager[None]]


@dataclass(frozen=True)
class Variant:
    """One endpoint: `kind` and `size` name it; `weights` edits the fp32 model's parameters in place; `patch` is
    entered around its forwards (a quantizer or matmul variant); `correct` says it must PASS."""

    kind: str
    size: str
    correct: bool = False
    weights: Callable[[K3Reference], None] | None = None
    patch: Patch | None = None
    smallest: bool = False  # run by --quick (and CI): the smallest fault of its kind


@contextlib.contextmanager
def _patched(module: Any, name: str, fn: Callable[..., Any]) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, fn)
    try:
        yield
    finally:
        setattr(module, name, old)


def _scale(name: str, factor: float) -> Callable[[K3Reference], None]:
    def edit(model: K3Reference) -> None:
        param = dict(model.named_parameters())[name]
        param.data.mul_(factor)
    return edit


def _double_block(name: str) -> Callable[[K3Reference], None]:
    def edit(model: K3Reference) -> None:
        param = dict(model.named_parameters())[name]
        param.data[0, :32].mul_(2.0)  # the first 32-value block of its first row
    return edit


def _codes(*, half_away: bool = False, clamp: int = 127, block: int = 32, fp32_scale: bool = False,
           reciprocal: bool = False) -> Patch:
    """Fn.q8_0_codes computed another way: rounding ties away from zero, codes clamped to +-`clamp`, blocks of
    `block` values, the scale d kept in fp32 instead of rounded to fp16, or id = 127 x (1/max|x|)."""

    def codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        K = x.shape[-1]
        blocks = x.float().reshape(*x.shape[:-1], K // block, block)
        amax = blocks.abs().amax(dim=-1, keepdim=True)
        safe = amax.clamp_min(torch.finfo(torch.float32).tiny)
        inv = 127.0 * (1.0 / safe) if reciprocal else torch.full_like(amax, 127.0) / safe
        inv = torch.where(amax > 0, inv, torch.zeros_like(amax))
        scaled = blocks * inv
        q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5) if half_away else torch.round(scaled)
        q = q.clamp(-clamp, clamp)
        d = amax / 127.0 if fp32_scale else (amax / 127.0).to(torch.float16).float()
        return scaled, q, d

    def value(q: torch.Tensor, d: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return (q * d).reshape(like.shape).to(like.dtype)

    @contextlib.contextmanager
    def patch() -> Iterator[None]:
        with _patched(Fn, "q8_0_codes", codes), _patched(Fn, "q8_0_value", value):
            yield
    return patch


def _matmul(noisy: bool) -> Patch:
    """Fn.linear with one ulp (2^-24 relative, fp32) of seeded noise on every output, or correctly rounded:
    computed in fp64 and rounded once to fp32."""
    plain = Fn.linear

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return plain(x, weight)
        if not noisy:
            return (x.double() @ weight.double().t()).float()
        out = plain(x, weight)
        g = torch.Generator().manual_seed(out.numel())
        return out * (1.0 + 2.0 ** -24 * torch.randn(out.shape, generator=g, dtype=torch.float32))

    @contextlib.contextmanager
    def patch() -> Iterator[None]:
        with _patched(Fn, "linear", linear):
            yield
    return patch


def variants() -> list[Variant]:
    out = [Variant("none (fault-free)", "-", correct=True, smallest=True)]
    for name, label in ((ROUTED, "routed expert w3"), (MLA, "MLA o_proj"),
                        ("model.layers.0.self_attn.q_proj.weight", "KDA q_proj")):
        for i, size in enumerate((1e-5, 1e-4, 1e-3)):
            out.append(Variant(f"scale {label}", f"x(1+{size:g})", weights=_scale(name, 1 + size),
                               smallest=i == 0 and name == ROUTED))
    out += [
        Variant("block x2", f"{ROUTED}[0,:32]", weights=_double_block(ROUTED), smallest=True),
        Variant("quantizer", "round half away from zero", patch=_codes(half_away=True), smallest=True),
        Variant("quantizer", "clamp at 126", patch=_codes(clamp=126), smallest=True),
        Variant("quantizer", "block 16", patch=_codes(block=16), smallest=True),
        Variant("quantizer", "fp32 scale", patch=_codes(fp32_scale=True), smallest=True),
        Variant("correct: matmul noise", "1 ulp", correct=True, patch=_matmul(True), smallest=True),
        Variant("correct: quantizer", "127 x (1/max)", correct=True, patch=_codes(reciprocal=True), smallest=True),
        Variant("correct: matmul", "correctly rounded", correct=True, patch=_matmul(False), smallest=True),
    ]
    return out


def prompt_set(target: Target, seed: int) -> list[list[int]]:
    """Prompts of the quick suite's lengths, drawn in order from torch.Generator().manual_seed(seed)."""
    g = torch.Generator().manual_seed(seed)
    vocab = int(target.tokenizer().num_base_tokens)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _model(target: Target, variant: Variant) -> K3Reference:
    from k3verify.checkpoint.loader import load_into  # noqa: PLC0415 (import cost only where the sweep runs)
    model = K3Reference(target.cfg, torch.float32)
    load_into(model, target.cfg, target.weights())
    if variant.weights is not None:
        variant.weights(model)
    return model.eval()


@dataclass
class Answers:
    """A variant's greedy answers as a server would send them, and its full log-softmax rows [8, V] per prompt."""

    greedy: list[Greedy]
    rows: list[torch.Tensor]


def answers(target: Target, variant: Variant, prompts: list[list[int]], precision: str,
            guesses: list[list[int]] | None = None) -> Answers:
    """The variant's greedy answers (NEW_TOKENS each) with its own top-k logprobs, as a server would send. A
    causal model's logits at a position depend only on the tokens up to it, so one forward over the prompt and a
    guess of the answer (`guesses`, e.g. the fault-free one) checks every guessed token at once; from the first
    one that is not the variant's greedy choice the answer is computed again."""
    model, emulation = _model(target, variant), get_precision(precision)
    out, full = [], []
    for i, prompt in enumerate(prompts):
        tokens = list(guesses[i]) if guesses is not None else []
        while True:
            guess = (tokens + [0] * NEW_TOKENS)[:NEW_TOKENS]
            with torch.no_grad(), emulation.emulated(), (variant.patch or contextlib.nullcontext)():
                logits = model(torch.tensor(prompt + guess[:-1])).logits[len(prompt) - 1:]
            rows = torch.log_softmax(logits.double(), dim=-1)
            choice = rows.argmax(dim=-1).tolist()
            wrong = next((p for p in range(NEW_TOKENS) if choice[p] != guess[p]), None)
            if wrong is None:
                break
            tokens = guess[:wrong] + [choice[wrong]] + choice[wrong + 1:]
        steps = []
        for p, token in enumerate(guess):
            top = rows[p].topk(TOP_K)
            steps.append(Step(token, float(rows[p, token]), dict(zip(top.indices.tolist(), top.values.tolist(),
                                                                      strict=True))))
        answer = Answer("", "length", steps)
        out.append(Greedy(prompt, answer, answer.resolved_ids(), 0))
        full.append(rows)
    return Answers(out, full)


def own_distance(fault: Answers, clean: Answers) -> float | None:
    """How far the fault alone moves what the check compares: the rel RMS of the variant's rows from the
    fault-free endpoint's, at the fault-free endpoint's top-k tokens, each row centred (None where the greedy
    tokens differ: the rows are then not of the same positions)."""
    if [g.tokens for g in fault.greedy] != [g.tokens for g in clean.greedy]:
        return None
    cand, ref = [], []
    for f, c in zip(fault.rows, clean.rows, strict=True):
        top = c.topk(TOP_K, dim=-1).indices
        cand.append(f.gather(-1, top))
        ref.append(c.gather(-1, top))
    a, b = torch.cat(cand), torch.cat(ref)
    a, b = a - a.mean(dim=1, keepdim=True), b - b.mean(dim=1, keepdim=True)
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@dataclass
class Outcome:
    variant: Variant
    seed: int
    excused: Result
    plain: Result | None  # the excuse switched off; judged only where the excused verdict is a pass
    seconds: float
    own: float | None = None  # own_distance from the fault-free endpoint

    def flipped(self, clean: float) -> bool:
        """A FAIL that became a PASS through the excuse, the distance after excusing beyond 1.5x `clean` (the
        fault-free run's distance after excusing, on the same prompts): what no fault may do."""
        return (not self.variant.correct and self.plain is not None and self.plain.status == "fail"
                and self.excused.status in PASSED and self.excused.metric > 1.5 * clean)


class Judge:
    """endpoint.logprobs.topk on answers, declared at `precision`, the oracle's models and runs shared."""

    def __init__(self, target: Target, precision: str) -> None:
        self.target, self.precision = target, get_precision(precision)
        self.cache: dict[str, Any] = {}

    def __call__(self, greedy: list[Greedy], *, excuse: bool) -> Result:
        endpoint = SimpleNamespace(precision=self.precision, dtype=self.precision.dtype, accepted=[],
                                   excuse_roundings=excuse)
        self.cache.pop(eo.EXCUSED, None)
        self.cache["endpoint.greedy"] = greedy
        ctx = CheckContext(self.target, torch.device("cpu"), 0, torch.Generator(), "quick", self.cache,
                           endpoint)  # type: ignore[arg-type]
        trial = check_topk_logprobs(ctx)
        return evaluate_trial(REGISTRY.get("endpoint.logprobs.topk"), trial)


def run(judge: Judge, variant: Variant, seed: int, clean: Answers | None = None, *,
        both: bool = False) -> tuple[Outcome, Answers]:
    """The variant judged with the excuse, and without it where that passed (or `both`)."""
    start = time.perf_counter()
    got = answers(judge.target, variant, prompt_set(judge.target, seed), judge.precision.name,
                  None if clean is None else [g.tokens for g in clean.greedy])
    excused = judge(got.greedy, excuse=True)
    plain = judge(got.greedy, excuse=False) if both or excused.status in PASSED else None
    own = None if clean is None else own_distance(got, clean)
    return Outcome(variant, seed, excused, plain, time.perf_counter() - start, own), got


def sweep(target: Target, precision: str, seeds: list[int], *, quick: bool,
          report: Callable[[Outcome], None] = lambda o: None) -> list[Outcome]:
    """Every variant (the smallest of each kind with `quick`) on every prompt set, the fault-free one first."""
    judge, out = Judge(target, precision), []
    for seed in seeds:
        outcome, clean = run(judge, variants()[0], seed, both=not quick)
        report(outcome)
        out.append(outcome)
        for v in variants()[1:]:
            if quick and not v.smallest:
                continue
            out.append(run(judge, v, seed, clean, both=not quick)[0])
            report(out[-1])
    return out


def _verdict(r: Result | None) -> str:
    if r is None:
        return "-"
    excused = int(r.metrics.get("excused_rounding_near_ties", 0))
    return f"{r.status} {r.metric:.3g} / {r.bar:.3g}" + (f", {excused} excused" if excused else "")


def row(o: Outcome) -> str:
    own = "-" if o.own is None else f"{o.own:.3g}"
    return (f"| {o.variant.kind} | {o.variant.size} | {o.seed} | {'must pass' if o.variant.correct else 'fault'} | "
            f"{_verdict(o.plain)} | {_verdict(o.excused)} | {own} | {o.seconds:.0f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", default="k3-tp4")
    parser.add_argument("--precision", default="w4a8-q8act")
    parser.add_argument("--seeds", default="1,2,3,4,5", help="prompt sets: torch.Generator seeds")
    parser.add_argument("--quick", action="store_true", help="the smallest fault of each kind only")
    parser.add_argument("--json", help="write every outcome here")
    args = parser.parse_args(argv)
    print("| variant | size | prompt set | expected | without the excuse (distance / bar) | with it | fault alone "
          "| s |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    outcomes = sweep(resolve_target(args.preset), args.precision, [int(s) for s in args.seeds.split(",")],
                     quick=args.quick, report=lambda o: print(row(o), flush=True))
    if args.json:
        records = [{"kind": o.variant.kind, "size": o.variant.size, "seed": o.seed, "correct": o.variant.correct,
                    "with": o.excused.status.value, "with_metric": o.excused.metric, "bar": o.excused.bar,
                    "excused": o.excused.metrics.get("excused_rounding_near_ties", 0.0), "own": o.own,
                    "without": None if o.plain is None else o.plain.status.value,
                    "without_metric": None if o.plain is None else o.plain.metric} for o in outcomes]
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
