"""Speculative decoding below HTTP: the n-gram drafter, greedy / rejection-sampling acceptance, the auto-off
policy, and the engine's speculative step on k3-tiny (fp32) against plain greedy generation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from k3verify.gates.shared.engine_run import collect_events
from k3verify.serving.engine import Engine, EngineEvent
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner, generate_greedy
from k3verify.serving.sampler import SamplingParams
from k3verify.serving.spec.accept import accept_greedy, accept_sampled, token_probs
from k3verify.serving.spec.drafter import ControlledDrafter, NgramDrafter, WithoutDrafts
from k3verify.serving.spec.offline import generate_speculative
from k3verify.serving.spec.policy import CostPolicy, SpecPolicy, SpecStats
from k3verify.serving.spec.scorer import SpecScorer
from k3verify.serving.spec.step import SpeculativeStep, build_speculative_step
from k3verify.serving.spec.step_timer import StepTimer
from k3verify.tokenizer import default_tokenizer

K = 4


def test_ngram_drafter_follows_the_longest_most_recent_suffix_match() -> None:
    """The 3-token suffix [7, 8, 9] matched last at index 4 wins over the 1-token match of 9 at index 2."""
    d = NgramDrafter(num_draft=3, max_ngram=3)
    assert d.propose(0, [1, 9, 5, 7, 8, 9, 6, 1, 2, 7, 8, 9]) == [6, 1, 2]
    assert d.propose(0, [5, 9, 1, 2, 9]) == [1, 2, 9]  # only a 1-gram matches: what followed the earlier 9
    assert d.propose(0, [1, 2, 3, 4]) == []  # no earlier occurrence of any suffix
    assert d.propose(0, [3, 4, 3]) == [4, 3]  # the continuation is cut where the text ends


def test_controlled_drafter_corrupts_the_asked_fraction() -> None:
    ref = list(range(2000))
    half = ControlledDrafter(4, {0: ref}, corrupt=0.5, vocab_size=5000, seed=1)
    drafts = [t for m in range(0, 1996, 4) for t in half.propose(0, ref[:m])]
    wrong = sum(d != r for d, r in zip(drafts, ref[:len(drafts)], strict=True)) / len(drafts)
    assert 0.45 < wrong < 0.55
    assert ControlledDrafter(4, {0: ref}, corrupt=0.0, vocab_size=5000).propose(0, ref[:10]) == ref[10:14]
    assert all(d != r for d, r in zip(ControlledDrafter(4, {0: ref}, 1.0, 5000).propose(0, ref[:10]), ref[10:14],
                                      strict=True))


def test_greedy_acceptance_keeps_the_matching_prefix_and_adds_the_bonus() -> None:
    logits = torch.zeros(4, 10)
    for j, best in enumerate([3, 5, 7, 1]):
        logits[j, best] = 1.0
    assert accept_greedy(logits, [3, 5, 2]).tokens == [3, 5, 7] and accept_greedy(logits, [3, 5, 2]).num_accepted == 2
    assert accept_greedy(logits, [4, 5, 7]).tokens == [3]
    assert accept_greedy(logits, [3, 5, 7]).tokens == [3, 5, 7, 1]


@pytest.mark.parametrize("draft", [0, 5, 2])
def test_rejection_sampling_emits_tokens_distributed_as_the_model(draft: int) -> None:
    """First emitted token ~ p_0 (8k draws, total variation < 0.02; measured 0.009-0.011) for a likely draft (0), an
    unlikely one (5) and one top-k filters out (2); given an accepted draft (>= 5k times), the second token ~ p_1."""
    V, params = 6, SamplingParams(max_tokens=4, temperature=0.8, top_k=5)
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0, -0.5], [0.0, 1.5, 0.3, -1.0, 0.7, 0.0],
                           [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    first, second = torch.zeros(V), torch.zeros(V)
    for position in range(8000):  # one seeded request's counter-based numbers at 8k positions
        toks = accept_sampled(logits, [draft, 1], params, 7, position * 3).tokens
        first[toks[0]] += 1
        if toks[0] == draft and len(toks) > 1:
            second[toks[1]] += 1
    p0, p1 = token_probs(logits[0], params), token_probs(logits[1], params)
    assert 0.5 * float((first / first.sum() - p0).abs().sum()) < 0.02
    if second.sum() >= 5000:
        assert 0.5 * float((second / second.sum() - p1).abs().sum()) < 0.02
    else:
        assert draft != 0, "the likely draft must be accepted often"


def test_policy_turns_speculation_off_only_when_acceptance_stays_low() -> None:
    policy, low, high = SpecPolicy(min_scores=3, min_mean_accepted=0.25), SpecStats(), SpecStats()
    for _ in range(2):
        policy.record(low, K, 0)
    assert not low.off, "too early to judge"
    policy.record(low, K, 0)
    assert low.off
    for a in (0, 0, 1, 0, 2):
        policy.record(high, K, a)
    assert not high.off


@pytest.fixture(scope="module")
def tiny_model() -> ServingModel:
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors
    from k3verify.presets import get_preset

    cfg = get_preset("k3-tiny")
    return ServingModel(cfg, torch.float32, "cpu").load(synthetic_tensors(cfg, seed=0))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (6, 19, 11)]


def _lookup_prompts() -> list[list[int]]:
    """Two prompts of 1,500 distinct token ids: a random-weight model's tokens rarely repeat its context, but about
    a third of them occur in such a prompt, so the n-gram drafter finds 1-gram matches (whose drafts it then loses)."""
    g = torch.Generator().manual_seed(5)
    return [torch.randperm(4608, generator=g)[:1500].tolist() for _ in range(2)]


def test_offline_speculation_with_ngram_drafts_equals_plain_greedy(tiny_model: ServingModel) -> None:
    """Score passes over n-gram drafts leave the output equal to plain greedy's."""
    prompts = _lookup_prompts()
    plain = generate_greedy(ModelRunner(tiny_model, num_pages=400, page_size=8, num_slots=2, max_context=1600),
                            prompts, 12)
    scorer = SpecScorer(ModelRunner(tiny_model, num_pages=400, page_size=8, num_slots=2, max_context=1600), K, 2)
    run = generate_speculative(scorer, NgramDrafter(K), prompts, 12, policy=SpecPolicy(min_mean_accepted=0.0))
    assert run.tokens == plain
    assert run.score_steps > 0, "the drafter never proposed: the test proves nothing"
    scorer.runner.check_integrity()


def test_rows_that_turned_speculation_off_finish_on_the_plain_device_fed_path(tiny_model: ServingModel) -> None:
    """Every draft wrong (corrupt=1): the policy turns each row off after 3 scores, the rest is decoded in
    one device-fed tail (offline._plain_tail) and equals plain greedy token for token."""
    prompts, new = _prompts(), 20
    plain = generate_greedy(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128),
                            prompts, new)
    refs = {i: p + t for i, (p, t) in enumerate(zip(prompts, plain, strict=True))}
    scorer = SpecScorer(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128), K, 3)
    run = generate_speculative(scorer, ControlledDrafter(K, refs, 1.0, 4608), prompts, new,
                               policy=SpecPolicy(min_scores=3, min_mean_accepted=0.25))
    assert run.tokens == plain
    assert all(s.off for s in run.stats) and run.score_steps == 3
    assert run.decode_steps == new - 1 - 3, "one tail step per remaining token (the first came from the prefill)"
    assert scorer.runner.active_ids == []


def test_rows_without_drafts_ride_along_instead_of_a_decode_step(tiny_model: ServingModel) -> None:
    """One row drafts, two have nothing to score: they ride along in its score passes with filler drafts, so
    while it speculates no round also runs a decode step (a score and a decode step per round cost a batch of 16
    38% of plain speed on the H200); decode steps only finish the riders after it is done, and every row ends
    with plain greedy's tokens."""
    prompts, new = _prompts(), 16
    plain = generate_greedy(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128),
                            prompts, new)
    refs = {0: prompts[0] + plain[0]}
    scorer = SpecScorer(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128), K, 3)
    run = generate_speculative(scorer, WithoutDrafts(ControlledDrafter(K, refs, 0.3, 4608, seed=1), {1, 2}), prompts,
                               new, policy=SpecPolicy(min_mean_accepted=0.0))
    assert run.tokens == plain
    assert run.score_steps > 0 and run.rider_rows == 2 * run.score_steps, run
    # rows 1 and 2 need new - 1 tokens after the prefill; each score pass gave them one (or more): only the rest
    # took decode steps (without riders: new - 1 decode steps, one per round, next to every score pass)
    assert run.decode_steps <= new - 1 - run.score_steps, run
    assert run.stats[1].scores == run.stats[2].scores == 0, "a rider's fillers were counted as drafts"
    scorer.runner.check_integrity()


def test_rows_near_their_end_still_score_instead_of_a_decode_step(tiny_model: ServingModel) -> None:
    """Every row drafts at 50%: rows get ahead of each other, and a row within k tokens of its end still has room
    for a score pass (k positions reserved past its need, scheduler.spec_reservation), so no round runs a decode
    step beside the batch's score pass. Without the reservation this run takes decode steps (a kl-48b-8l batch of
    16 at 50%: 35 beside 36 score steps on the H200)."""
    from k3verify.serving.scheduler import spec_reservation
    from k3verify.serving.spec.offline import useful_drafts

    prompts, new = _prompts(), 17
    plain = generate_greedy(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128),
                            prompts, new)
    refs = {i: p + t for i, (p, t) in enumerate(zip(prompts, plain, strict=True))}

    def run_with(reserve: bool) -> Any:
        scorer = SpecScorer(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128), K, 3)
        drafter = ControlledDrafter(K, refs, 0.5, 4608, seed=3)
        if reserve:
            return generate_speculative(scorer, drafter, prompts, new, policy=SpecPolicy(min_mean_accepted=0.0))
        with pytest.MonkeyPatch.context() as mp:  # the reservation off: each row reserves exactly its need
            mp.setattr("k3verify.serving.spec.offline.spec_reservation", lambda runner, need, k, limit: need)
            return generate_speculative(scorer, drafter, prompts, new, policy=SpecPolicy(min_mean_accepted=0.0))

    run, without = run_with(True), run_with(False)
    assert run.tokens == plain == without.tokens
    assert run.score_steps > 0 and run.decode_steps == 0, run
    assert without.decode_steps > 0, "the control needs rows that ran out of room: the test proves nothing"
    runner = ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128)
    assert spec_reservation(runner, 100, K, 128) == 100 + K and spec_reservation(runner, 126, K, 128) == 126
    # drafts past a row's end are not counted as drafted (nor as accepted): the measured acceptance stays the
    # drafter's; a row with one token to go only rides along
    assert [useful_drafts(K, left) for left in (1, 2, 3, 9)] == [0, 1, 2, K]
    assert sum(s.drafted for s in run.stats) < K * run.score_steps * len(prompts)


def test_plain_tail_with_rows_of_unequal_lengths(tiny_model: ServingModel) -> None:
    """Rows 5, 2 and 0 tokens ahead when the tail starts: the batch shrinks as rows finish (a prefix of the rows
    sorted by need) and every row still ends with plain greedy's tokens."""
    from k3verify.serving.spec.offline import SpecRun, _plain_tail

    prompts, new = _prompts(), 12
    plain = generate_greedy(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128),
                            prompts, new)
    runner = ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128)
    for sid, p in enumerate(prompts):
        runner.admit(sid, len(p) + new)
    first = runner.prefill(list(enumerate(prompts))).argmax(-1).tolist()
    run = SpecRun([[t] for t in first], [SpecStats() for _ in prompts])
    for row, ahead in ((0, 5), (1, 2)):
        for _ in range(ahead):
            run.tokens[row] += runner.decode([(row, run.tokens[row][-1])]).argmax(-1).tolist()
    _plain_tail(SpecScorer(runner, K, 3), [0, 1, 2], [0, 1, 2], run, new, None)
    assert run.tokens == plain and run.decode_steps == new - 1
    for sid in range(3):
        assert runner.num_cached(sid) == len(prompts[sid]) + new - 1


def _engine_run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[EngineEvent]]:
    engine.start()
    try:
        events = collect_events(engine, requests, timeout_s=60)
        engine.check_integrity()
    finally:
        engine.stop()
    return events


def test_engine_speculative_greedy_equals_plain_greedy(tiny_model: ServingModel) -> None:
    """Greedy requests through the engine's speculative step (drafts: plain greedy's continuation, 40% corrupted)
    return plain greedy's tokens and logprobs' token ids; score rows were partially accepted."""
    prompts, new = _prompts(), 14
    plain = generate_greedy(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128),
                            prompts, new)
    runner = ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128)
    refs = {i + 1: p + o for i, (p, o) in enumerate(zip(prompts, plain, strict=True))}  # engine ids start at 1
    step = SpeculativeStep(SpecScorer(runner, K, 3), ControlledDrafter(K, refs, 0.4, 4608, seed=2),
                           SpecPolicy(min_mean_accepted=0.0))
    engine = Engine(runner, default_tokenizer(), eos_token_ids=(0,), vocab_size=4608, speculator=step)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=0)
    events = _engine_run(engine, [(p, params) for p in prompts])
    for want, evs in zip(plain, events, strict=True):
        assert [t for e in evs for t in e.token_ids] == want
        assert [lp.token_id for e in evs for lp in e.logprobs] == want
        assert evs[-1].finish_reason == "length" and evs[-1].completion_tokens == new
    c = step.counters
    assert c.score_steps > 0 and 0 < c.accepted < c.drafted, f"no partial acceptance: {c}"


def test_engine_greedy_rows_ride_along_sampled_rows_decode(tiny_model: ServingModel) -> None:
    """In the engine: a greedy row without drafts rides along in the score pass of a drafting row (its tokens
    still plain greedy's); a sampled row without drafts does not (its seeded draws stay on the decode path)."""
    prompts, new = _prompts(), 12
    plain = generate_greedy(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128),
                            prompts, new)
    runner = ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128)
    refs = {1: prompts[0] + plain[0]}  # engine ids start at 1
    step = SpeculativeStep(SpecScorer(runner, K, 3), WithoutDrafts(ControlledDrafter(K, refs, 0.3, 4608), {2, 3}),
                           SpecPolicy(min_mean_accepted=0.0))
    engine = Engine(runner, default_tokenizer(), eos_token_ids=(0,), vocab_size=4608, speculator=step)
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=new, temperature=0.8, seed=5, ignore_eos=True)
    events = _engine_run(engine, [(prompts[0], greedy), (prompts[1], greedy), (prompts[2], sampled)])
    for want, evs in zip(plain[:2], events[:2], strict=True):
        assert [t for e in evs for t in e.token_ids] == want
    assert len([t for e in events[2] for t in e.token_ids]) == new
    c = step.counters
    assert c.score_steps > 0 and c.rider_rows >= c.score_steps - 1, c
    assert c.scored_rows == c.score_steps, "only the drafting row counts as scored"


def test_engine_speculative_sampling_is_seeded_and_stops(tiny_model: ServingModel) -> None:
    """Sampled requests through the speculative step: a seed reproduces the tokens, max_tokens is honoured
    exactly even when a score accepts past it, and the caches come back intact."""
    def once() -> list[list[int]]:
        runner = ModelRunner(tiny_model, num_pages=400, page_size=8, num_slots=2, max_context=1600)
        step = build_speculative_step(runner, "ngram", K, 2, policy=SpecPolicy(min_mean_accepted=0.0))
        engine = Engine(runner, default_tokenizer(), eos_token_ids=(0,), vocab_size=4608, speculator=step)
        reqs = [(p, SamplingParams(max_tokens=9, temperature=0.7, seed=11 + i, ignore_eos=True))
                for i, p in enumerate(_lookup_prompts())]
        events = _engine_run(engine, reqs)
        assert step.counters.score_steps > 0
        return [[t for e in evs for t in e.token_ids] for evs in events]

    first = once()
    assert first == once()
    assert [len(t) for t in first] == [9, 9]


def test_serve_speculative_flags_are_checked(tiny_model: ServingModel) -> None:
    """serve: --kda-fused-score needs --speculative; --num-draft must be positive; default is no speculator."""
    import dataclasses

    from k3verify.cli import build_parser
    from k3verify.commands.serve_engine import _speculator
    from k3verify.commands.serve_options import ServeOptions
    from k3verify.errors import UsageError

    runner = ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128)
    base = ServeOptions.from_args(build_parser().parse_args(["serve", "--max-batch", "3"]))

    def args(**kw: Any) -> ServeOptions:
        return dataclasses.replace(base, **kw)

    assert _speculator(args(), runner) is None
    with pytest.raises(UsageError, match="--kda-fused-score"):
        _speculator(args(kda_fused_score=True), runner)
    with pytest.raises(UsageError, match="num-draft"):
        _speculator(args(speculative="ngram", num_draft=0), runner)
    step = _speculator(args(speculative="ngram", num_draft=3, kda_fused_score=True), runner)
    assert step is not None and step.scorer.num_draft == 3 and step.scorer.fused
    assert isinstance(step.cost_policy, CostPolicy), "serve holds scoring to by its cost unless told not to"
    step = _speculator(args(speculative="ngram", no_spec_cost_policy=True), runner)
    assert step is not None and step.cost_policy is None


def test_cost_policy_probes_then_decides_by_measured_step_times() -> None:
    """A batch size's first two drafted steps score (probes: the faster one counts), the next decodes plainly (to
    time it), then the rule: tokens per row expected from the rows' acceptance (with the prior) against score /
    decode time. A declined batch size probes again after reprobe_after declined steps, then after twice as many."""
    cost = CostPolicy(reprobe_after=3)
    none = SpecStats()
    assert cost.score_now(16, [none], 0, 4)  # nothing timed: probe
    cost.record_score(16, 0.030)  # a first step with one-time costs
    assert cost.score_now(16, [none], 0, 4), "one slow first score does not decide: probe again"
    cost.record_score(16, 0.009)
    assert not cost.score_now(16, [none], 0, 4)  # score timed, plain not yet: time a plain step
    cost.record_decode(16, 0.003)
    bad, good = SpecStats(scores=1, drafted=4, accepted=0), SpecStats(scores=1, drafted=4, accepted=4)
    assert cost.expected_accepted(bad, 4) == pytest.approx(1.0) and cost.expected_accepted(good, 4) == 3.0
    assert cost.score_now(16, [good], 0, 4)  # 4 tokens a row >= 3x the time
    assert not cost.score_now(16, [bad], 0, 4)  # 2 tokens a row < 3x
    assert not cost.score_now(16, [good], 3, 4)  # riders dilute: (4 + 3) / 4 rows < 3
    # two declined above; the third probes, then the sixth after it, then the twelfth
    assert [cost.score_now(16, [bad], 0, 4) for _ in range(9)] == [True] + [False] * 5 + [True, False, False]
    assert cost.score_now(1, [bad], 0, 4), "another batch size is timed on its own"
    near_end = SpecStats(scores=2, drafted=5, accepted=5)  # all accepted, the last score had 1 countable draft
    assert cost.expected_accepted(near_end, 4) == pytest.approx(4 * 7 / 9), "a rate: short last rounds are no loss"
    cost.record_score(16, 0.012)
    assert cost.describe() == {"verify_ms": {"16": 9.0}, "decode_ms": {"16": 3.0}}, "the fastest step is kept"


def test_cost_policy_sends_an_expensive_score_to_plain_decode_offline(tiny_model: ServingModel) -> None:
    """Offline, with step times where a score costs 10 decode steps (control: 1), every draft right: the cost policy
    never scores and the run is plain greedy's; with equal times it scores. Greedy output is the same both
    ways: the cost policy only chooses how tokens are made."""
    prompts, new = _prompts(), 12
    plain = generate_greedy(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128),
                            prompts, new)
    refs = {i: p + t for i, (p, t) in enumerate(zip(prompts, plain, strict=True))}
    runs = {}
    for ratio in (10.0, 1.0):
        cost = CostPolicy(score_s={3: ratio * 1e-9}, decode_s={3: 1e-9})  # below any real step: kept as the fastest
        scorer = SpecScorer(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128), K, 3)
        runs[ratio] = generate_speculative(scorer, ControlledDrafter(K, refs, 0.0, 4608), prompts, new,
                                           policy=SpecPolicy(min_mean_accepted=0.0), cost_policy=cost)
        assert runs[ratio].tokens == plain
    assert runs[10.0].score_steps == 0 and runs[10.0].cost_off
    assert runs[1.0].score_steps > 0 and not runs[1.0].cost_off and runs[1.0].acceptance == 1.0


def _cost_policy_engine_run(model: ServingModel, new: int, cost: CostPolicy, graphs: bool = False
                      ) -> tuple[list[list[int]], list[list[int]], SpeculativeStep]:
    """Plain greedy tokens of _prompts(), then the engine's greedy tokens with a speculative step under `cost`
    (drafts: plain greedy's continuation, none corrupted), and that step."""
    prompts = _prompts()
    plain = generate_greedy(ModelRunner(model, num_pages=40, page_size=8, num_slots=3, max_context=128), prompts, new)
    runner = ModelRunner(model, num_pages=40, page_size=8, num_slots=3, max_context=128)
    refs = {i + 1: p + o for i, (p, o) in enumerate(zip(prompts, plain, strict=True))}
    step = SpeculativeStep(SpecScorer(runner, K, 3), ControlledDrafter(K, refs, 0.0, 4608),
                           SpecPolicy(min_mean_accepted=0.0), cost)
    engine = Engine(runner, default_tokenizer(), eos_token_ids=(0,), vocab_size=4608, speculator=step,
                    graphs=GraphDecoder(model, 128, buckets=(4,), use_graphs=False) if graphs else None)
    events = _engine_run(engine, [(p, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
                                  for p in prompts])
    return plain, [[t for e in evs for t in e.token_ids] for evs in events], step


def test_engine_cost_policy_declines_scores_and_keeps_greedy_output(tiny_model: ServingModel) -> None:
    """The engine's speculative step under a cost policy whose measured score costs 10 plain steps: drafted steps go to
    plain decode (counted), output is plain greedy's; the engine times its own plain steps for the cost policy."""
    cost = CostPolicy(score_s={3: 10.0}, decode_s={3: 1.0}, reprobe_after=1000)
    plain, tokens, step = _cost_policy_engine_run(tiny_model, 10, cost)
    assert tokens == plain
    assert step.counters.score_steps == 0 and step.counters.declined_steps > 0
    assert cost.decode_s[3] < 1.0, "the engine timed its plain steps"
    assert step.counters.plain_ahead_steps > 0, "while the cost policy declines, the engine launches ahead"


def test_engine_leaves_launch_ahead_for_the_cost_policys_reprobe_and_keeps_greedy_output(
        tiny_model: ServingModel) -> None:
    """A cost policy that declines at batch 3 and probes again every few declined steps: the engine runs launch-ahead
    plain steps while it declines (drafts not asked for), drains the step in flight before each in-order step, and
    scores at each reprobe; the tokens equal plain greedy's throughout (every draft right: accepted ones show)."""
    # a plain step at 1 us: whatever the engine times, a score never pays except as a reprobe
    cost = CostPolicy(score_s={3: 10.0}, decode_s={3: 1e-6}, reprobe_after=2)
    plain, tokens, step = _cost_policy_engine_run(tiny_model, 16, cost)
    assert tokens == plain
    c = step.counters
    assert c.plain_ahead_steps > 0 and c.score_steps > 0 and c.declined_steps > 0, c
    assert c.accepted > 0, "the reprobes scored right drafts"


def test_cost_policy_take_plain_step_follows_its_last_decision_and_reprobes() -> None:
    cost = CostPolicy(score_s={4: 10.0}, decode_s={4: 1.0}, reprobe_after=3)
    assert not cost.take_plain_step(4), "nothing decided at 4 yet"
    assert not cost.score_now(4, [SpecStats()], 0, K)  # declined: 5 tokens a row expected < 10x
    assert cost.take_plain_step(4) and not cost.take_plain_step(8)
    assert not cost.take_plain_step(4), "the third declined step is the reprobe's: left to score_now"
    assert cost.score_now(4, [SpecStats()], 0, K), "reprobe"
    assert not cost.take_plain_step(4), "after a score the cost policy is not declining"


@pytest.mark.parametrize(("decode_ms", "scores"), [(1.19, False), (1.6, True)])
def test_cost_policy_third_score_at_zero_acceptance_depends_on_the_plain_step_time(decode_ms: float,
                                                                                    scores: bool) -> None:
    """H200 batch 1, k=4, score 2.1 ms, two probes that accepted 0 of 4 drafts: 1 + 4 * (0 + 2) / (8 + 4) = 1.67
    tokens a row expected; against a launch-ahead plain step (1.19 ms: 1.76x) the cost policy declines, against the
    in-order step's wall time (1.6 ms: 1.31x) it scores a third time."""
    cost, policy, stats = CostPolicy(), SpecPolicy(), SpecStats()
    for _ in range(cost.probes):
        assert cost.score_now(1, [stats], 0, K), "probe"
        cost.record_score(1, 2.1e-3)
        policy.record(stats, K, 0)
    assert not stats.off, "the request's own auto-off waits for its third score"
    assert not cost.score_now(1, [stats], 0, K), "score timed, plain not yet: a plain step to time"
    cost.record_decode(1, decode_ms * 1e-3)
    assert cost.score_now(1, [stats], 0, K) is scores


def test_step_timer_on_cpu_times_the_wall_clock_around_the_step() -> None:
    """On the CPU the step's span is the clock from construction to seconds() (readback included); seconds()
    before launched() is refused; a device it cannot time is refused."""
    timer = StepTimer(torch.device("cpu"))
    torch.ones(64, 64) @ torch.ones(64, 64)
    timer.launched()
    assert timer.seconds() > 0.0
    now = [10.0]
    timer = StepTimer(torch.device("cpu"), clock=lambda: now[0])
    with pytest.raises(RuntimeError, match="before launched"):
        timer.seconds()
    now[0] = 10.001
    timer.launched()
    now[0] = 10.0016  # after the readback
    assert timer.seconds() == pytest.approx(1.6e-3)
    with pytest.raises(ValueError, match="meta"):
        StepTimer(torch.device("meta"))


def _fake_cuda_events(monkeypatch: pytest.MonkeyPatch, device_ms: list[float]) -> None:
    """torch.cuda.Event and current_stream faked: each record() on the one fake stream takes the next of
    `device_ms`, and elapsed_time() refuses an end event that was not waited for (as CUDA does)."""
    stream, times = object(), iter(device_ms)

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing, "an event without timing has no elapsed_time"
            self.ms: float | None = None
            self.done = False

        def record(self, on: object = None) -> None:
            assert on is stream, "recorded on the step's stream"
            self.ms = next(times)

        def synchronize(self) -> None:
            self.done = True

        def elapsed_time(self, end: FakeEvent) -> float:
            if not end.done or self.ms is None or end.ms is None:
                raise RuntimeError("CUDA error: device not ready")
            return end.ms - self.ms

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)


def test_step_timer_on_cuda_takes_the_event_interval_not_the_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (events faked) the time is the events' interval on the step's stream (1.19 ms), not the clock
    around the step (1.6 ms), and the end event is waited for before it is read."""
    _fake_cuda_events(monkeypatch, [5.0, 6.19])
    ticks = iter([10.0, 10.0016, 10.0016])
    timer = StepTimer(torch.device("cuda"), clock=lambda: next(ticks))
    timer.launched()
    assert timer.seconds() == pytest.approx(1.19e-3)


def test_step_timer_starts_at_the_replay_inside_starting_at_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (events faked) a step timed inside starting_at_replay starts where the graphs call their hook (right
    before the replay, inputs filled): 1.19 ms of replay, not the 1.40 ms from before the fill and launch. The hook
    is the graphs' only while inside (cleared after an exception too); a second timer on the same step is
    refused; without graphs nothing is hooked."""
    from types import SimpleNamespace

    _fake_cuda_events(monkeypatch, [0.0, 5.0, 5.21, 6.40])
    graphs = SimpleNamespace(before_replay=None)
    other = StepTimer(torch.device("cuda"))  # 0.0
    timer = StepTimer(torch.device("cuda"))  # 5.0: before the fill and launch
    with timer.starting_at_replay(graphs):  # type: ignore[arg-type]
        assert graphs.before_replay == timer.restart
        with pytest.raises(RuntimeError, match="already set"), other.starting_at_replay(graphs):  # type: ignore[arg-type]
            pass
        graphs.before_replay()  # the replay: 5.21
    timer.launched()  # 6.40
    assert graphs.before_replay is None
    assert timer.seconds() == pytest.approx(1.19e-3)
    with pytest.raises(KeyError), timer.starting_at_replay(graphs):  # type: ignore[arg-type]
        raise KeyError("the step failed")
    assert graphs.before_replay is None
    with timer.starting_at_replay(None):
        pass


def test_graph_decoder_calls_its_hook_once_per_step_after_the_fill(tiny_model: ServingModel,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """GraphDecoder calls before_replay once per decode step, after its inputs were filled (here: the eager static
    step, which the hook precedes the same way), and the timed plain steps of the offline round and of the engine
    start their timer there."""
    runner = ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128)
    graphs = GraphDecoder(tiny_model, 128, buckets=(4,), use_graphs=False)
    runner.admit(0, 40)
    last = runner.prefill([(0, [5, 6, 7])]).argmax(-1).tolist()
    filled: list[bool] = []
    graphs.before_replay = lambda: filled.append(bool((graphs._inputs[4].input_ids[:1] == last[0]).all()))
    runner.decode([(0, last[0])], graphs)
    assert filled == [True]
    graphs.before_replay = None
    runner.release(0)

    restarts: list[int] = []
    real_restart = StepTimer.restart
    monkeypatch.setattr(StepTimer, "restart", lambda self: (restarts.append(1), real_restart(self)))
    cost = CostPolicy(score_s={3: 1e-9})  # score settled: the first drafted round is the cost policy's plain step
    scorer = SpecScorer(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128), K, 3)
    decode_graphs = GraphDecoder(scorer.runner.model, 128, buckets=(4,), use_graphs=False)
    generate_speculative(scorer, NgramDrafter(K), _prompts(), 8, cost_policy=cost, decode_graphs=decode_graphs)
    assert 3 in cost.decode_s and len(restarts) >= 1
    assert decode_graphs.before_replay is None
    restarts.clear()
    cost = CostPolicy(score_s={3: 10.0}, reprobe_after=1000)  # the engine's in-order plain step, timed for the policy
    _cost_policy_engine_run(tiny_model, 8, cost, graphs=True)
    assert 3 in cost.decode_s and len(restarts) >= 1


def test_offline_round_and_engine_give_the_cost_policy_the_step_timers_plain_time(
        tiny_model: ServingModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain step both paths time for the cost policy is StepTimer's (a sentinel here), offline and in engine."""
    monkeypatch.setattr(StepTimer, "seconds", lambda self: 0.25)
    cost = CostPolicy(score_s={3: 1e-9})  # score settled, plain not yet: the first drafted round decodes plainly
    scorer = SpecScorer(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128), K, 3)
    generate_speculative(scorer, NgramDrafter(K), _prompts(), 8, cost_policy=cost)
    assert cost.decode_s == {3: 0.25}
    cost = CostPolicy(score_s={3: 10.0}, reprobe_after=1000)
    _cost_policy_engine_run(tiny_model, 8, cost)
    assert cost.decode_s == {3: 0.25}


def test_commit_greedy_commits_what_commit_would_and_keeps_the_call_order(tiny_model: ServingModel) -> None:
    """commit_greedy (acceptance on the device, commit behind the score) leaves the caches and the runner's counts
    exactly as the host rule + commit would, on rows that accept none, some and all of their drafts; score before
    `committed`, and `committed` without a commit_greedy, are refused."""
    prompts = [[5, 6, 7, 8, 9], [11, 3, 3, 2], [7, 7, 1, 9, 4, 2]]
    truth = generate_greedy(ModelRunner(tiny_model, num_pages=32, page_size=4, num_slots=4, max_context=64),
                            prompts, K + 2)  # before the scorer's runner: a runner binds its caches to the model
    drafts = [[1, 2, 3, 4], truth[1][1:K + 1], [truth[2][1], 0, 0, 0]]  # none, all, one of them accepted

    def run(on_device: bool) -> tuple[list[int], dict[str, torch.Tensor], list[int]]:
        runner = ModelRunner(tiny_model, num_pages=32, page_size=4, num_slots=4, max_context=64)
        scorer = SpecScorer(runner, K, max_rows=3)
        for sid in range(len(prompts)):
            runner.admit(sid, 40)
        last = runner.prefill([(sid, p) for sid, p in enumerate(prompts)]).argmax(-1).tolist()
        logits = scorer.score([(sid, [last[sid], *d]) for sid, d in enumerate(drafts)])
        if on_device:
            out = scorer.commit_greedy(logits, drafts).tolist()
            with pytest.raises(RuntimeError, match="committed"):
                scorer.score([(0, [1] * (K + 1))])
            counts = [o[-1] for o in out]
            scorer.committed(counts)
        else:
            counts = [accept_greedy(logits[b], d).num_accepted for b, d in enumerate(drafts)]
            scorer.commit(counts)
        pool = runner.state_pool
        states = {"state": pool.state.clone(), "conv_q": pool.conv_q.clone(), "latents": runner.kv_cache.data.clone()}
        return counts, states, [runner.num_cached(sid) for sid in range(3)]

    host, device = run(False), run(True)
    assert host[0] == device[0] and host[2] == device[2], (host[0], device[0])
    assert host[0][1] == K and 1 <= host[0][2] < K and host[0][0] < K, host[0]
    for name, t in host[1].items():
        assert torch.equal(t, device[1][name]), name
    runner = ModelRunner(tiny_model, num_pages=8, page_size=4, num_slots=2, max_context=16)
    with pytest.raises(RuntimeError, match="without a commit_greedy"):
        SpecScorer(runner, K, max_rows=1).committed([0])


def test_commit_greedy_queues_the_readback_before_the_commit(tiny_model: ServingModel) -> None:
    """The ids and counts start their copy to the host before the commit's kernels are launched, so reading them
    does not wait for the commit; the copy holds [ids, count] per row, and the reject flag after them when given."""
    runner = ModelRunner(tiny_model, num_pages=24, page_size=4, num_slots=3, max_context=64)
    scorer = SpecScorer(runner, K, max_rows=2)
    for sid in range(2):
        runner.admit(sid, 24)
    last = runner.prefill([(0, [5, 6, 7]), (1, [9, 3, 4, 2])]).argmax(-1).tolist()
    order: list[str] = []
    start, launch = scorer.readback.start, scorer._launch_commit
    scorer.readback.start = lambda src: (order.append("readback"), start(src))[1]  # type: ignore[method-assign]
    scorer._launch_commit = lambda *a: (order.append("commit"), launch(*a))[1]  # type: ignore[method-assign]
    logits = scorer.score([(sid, [last[sid], 1, 2, 3, 4]) for sid in range(2)])
    rows = scorer.commit_greedy(logits, [[1, 2, 3, 4]] * 2, reject=torch.tensor([False, True])).tolist()
    assert order == ["readback", "commit"]
    assert [len(r) for r in rows] == [K + 3] * 2 and [r[-1] for r in rows] == [0, 1] and rows[1][-2] == 0, rows
    assert [r[:K + 1] for r in rows] == logits.argmax(-1).tolist()


def test_engine_score_row_with_nonfinite_logits_fails_its_request_alone(tiny_model: ServingModel) -> None:
    """One score pass gives one row NaN logits (injected): that request ends with a non-finite error, and the other
    requests still return plain greedy's tokens; the caches pass the integrity check. Control: without the injection
    every request completes with plain greedy's tokens."""
    prompts, new = _prompts(), 10
    plain = generate_greedy(ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128),
                            prompts, new)
    refs = {i + 1: p + o for i, (p, o) in enumerate(zip(prompts, plain, strict=True))}

    def run(inject: bool) -> tuple[list[list[EngineEvent]], ModelRunner]:
        runner = ModelRunner(tiny_model, num_pages=40, page_size=8, num_slots=3, max_context=128)
        scorer = SpecScorer(runner, K, 3)
        real_score = scorer.score
        calls = [0]

        def score(seqs: list[tuple[int, list[int]]], graphs: Any = None) -> torch.Tensor:
            logits = real_score(seqs, graphs)
            calls[0] += 1
            if inject and calls[0] == 2:
                rows = [sid for sid, _ in seqs]
                logits[rows.index(2)] = float("nan")  # request 2's row
            return logits

        scorer.score = score  # type: ignore[method-assign]
        step = SpeculativeStep(scorer, ControlledDrafter(K, refs, 0.3, 4608, seed=1),
                               SpecPolicy(min_mean_accepted=0.0))
        engine = Engine(runner, default_tokenizer(), eos_token_ids=(0,), vocab_size=4608, speculator=step)
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        return _engine_run(engine, [(p, params) for p in prompts]), runner

    events, runner = run(True)
    errors = [next((e.error for e in evs if e.error), None) for evs in events]
    assert errors[0] is None and errors[2] is None and "non-finite" in (errors[1] or ""), errors
    for i in (0, 2):
        assert [t for e in events[i] for t in e.token_ids] == plain[i]
    runner.check_integrity()
    control, _ = run(False)
    assert all(next((e.error for e in evs if e.error), None) is None for evs in control)
    assert [[t for e in evs for t in e.token_ids] for evs in control] == plain
