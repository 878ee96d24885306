"""Per-request auto-off: speculation stops for a request whose drafts keep being rejected.

A score pass costs more than a decode step (k+1 rows through every layer, more distinct experts per MoE
layer), so a request that gains nothing from it should decode plainly. Rule: after `min_scores` score
steps, and after every later one, if the request's accepted drafts per score step (over all its score
steps so far) fall below `min_mean_accepted`, that request decodes without speculation until it finishes.
At 0% acceptance this costs exactly `min_scores` score steps per request; min_mean_accepted=0 turns
the rule off.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    scores: int = 0
    drafted: int = 0
    accepted: int = 0
    off: bool = False


@dataclass(frozen=True)
class SpecPolicy:
    min_scores: int = 3
    min_mean_accepted: float = 0.25

    def __post_init__(self) -> None:
        if self.min_scores < 1 or self.min_mean_accepted < 0:
            raise ValueError(f"min_scores must be >= 1 and min_mean_accepted >= 0; got {self.min_scores}, "
                             f"{self.min_mean_accepted}")

    def record(self, stats: SpecStats, drafted: int, accepted: int) -> int:
        """One score of `drafted` countable drafts (offline.useful_drafts) that accepted `accepted` positions;
        what was accepted past the countable drafts is not counted. Returns the accepted count recorded."""
        accepted = min(accepted, drafted)
        stats.scores += 1
        stats.drafted += drafted
        stats.accepted += accepted
        if stats.scores >= self.min_scores and stats.accepted < self.min_mean_accepted * stats.scores:
            stats.off = True
        return accepted


@dataclass
class CostPolicy:
    """Batch-level: a score step runs only when it is expected to emit more tokens per second than a plain decode
    step of the same batch would, with both step times measured where it runs.

    The two times are not measured alike, because the two steps are not run alike. score_s is the wall time of a
    score round, launch to readback: a score is always in order (acceptance needs its ids on the host before the
    next step), so its host round trip is part of its cost. decode_s is a plain step as the alternative runs it:
    launch-ahead (step n+1 launched before step n is read back), so on CUDA it is the device's time from right
    before the graph replay to the end of the step's launches (step_timer.StepTimer.starting_at_replay). Timed in
    order, or from before its input fill, the plain step looks costlier than the launch-ahead step it stands for,
    enough to keep the policy scoring at 0% acceptance (docs/results/README.md has the runs).

    Why: per-request acceptance is not the whole cost. A score pass puts k+1 tokens of every row through the MoE
    layers, which then touch many more experts than a decode step's one token per row: a score step's cost relative
    to a decode step grows with the batch, so speculation that pays at batch 1 can lose at batch 16 at the same
    acceptance.

    Rule, per batch size b: until `probes` score steps of b rows were timed, score (probes); then, until a plain
    step of b rows was timed, decode plainly once; then score only if the expected tokens per row, (1 + expected
    accepted drafts) over drafting rows and 1 over riders, reach score_time[b] / decode_time[b]. A row's expected
    accepted drafts: k x (its accepted + the prior's) / (its countable drafts + the prior's), the prior being one
    score of k drafts that accepted half, so that one unlucky score does not condemn a request. Step times are the
    fastest seen (a first step can carry one-time costs, several times a later step's, which with one probe would
    decide the whole run), and a declined batch
    size probes again after reprobe_after declined steps, then after twice as many. Greedy output never depends on
    the cost policy: it only chooses how tokens are produced."""

    probes: int = 2  # timed score steps of a batch size before the rule decides there
    prior_scores: float = 1.0
    prior_accepted_fraction: float = 0.5
    reprobe_after: int = 64  # declined steps of a batch size before one score probes again (doubling each time)
    score_s: dict[int, float] = field(default_factory=dict)  # fastest score step seen, by batch size
    decode_s: dict[int, float] = field(default_factory=dict)  # fastest plain step seen (launch-ahead), by batch
    _timed: dict[int, int] = field(default_factory=dict, init=False, repr=False)  # score steps timed, by batch
    _declined: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _reprobe: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _declining: dict[int, bool] = field(default_factory=dict, init=False, repr=False)  # last decision, both times known

    def __post_init__(self) -> None:
        self._timed = {b: self.probes for b in self.score_s}  # times given up front are settled

    def record_score(self, batch: int, seconds: float) -> None:
        self.score_s[batch] = min(seconds, self.score_s.get(batch, float("inf")))
        self._timed[batch] = self._timed.get(batch, 0) + 1

    def record_decode(self, batch: int, seconds: float) -> None:
        self.decode_s[batch] = min(seconds, self.decode_s.get(batch, float("inf")))

    def expected_accepted(self, stats: SpecStats, num_draft: int) -> float:
        """k times the row's acceptance rate over its countable drafts, with the prior: a rate, so that the rounds
        near a request's end (fewer countable drafts) do not read as poor drafting."""
        prior = self.prior_scores * num_draft
        return num_draft * (stats.accepted + self.prior_accepted_fraction * prior) / (stats.drafted + prior)

    def score_now(self, batch: int, drafting: list[SpecStats], riders: int, num_draft: int) -> bool:
        """Whether this step of `batch` sequences should score its drafting rows (and riders) or decode plainly."""
        if self._timed.get(batch, 0) < self.probes:
            return True
        if batch not in self.decode_s:
            return False
        rows = len(drafting) + riders
        tokens = sum(1.0 + self.expected_accepted(s, num_draft) for s in drafting) + riders
        if tokens / max(rows, 1) >= self.score_s[batch] / self.decode_s[batch]:
            self._declining[batch] = False
            return True
        # Declined: a row's estimate only moves with scores, and a slow first score (a graph capture, say) would
        # otherwise decide for good; so every reprobe_after declined steps (doubling) one score probes again.
        declined = self._declined.get(batch, 0) + 1
        every = self._reprobe.setdefault(batch, self.reprobe_after)
        if declined >= every:
            self._declined[batch], self._reprobe[batch] = 0, 2 * every
            self._declining[batch] = False
            return True
        self._declined[batch], self._declining[batch] = declined, True
        return False

    def take_plain_step(self, batch: int) -> bool:
        """While the cost policy declines at this batch size (its last decision there, with both step times known, was
        plain decoding): count one more declined step and return True, so the caller may decode plainly without
        asking for drafts (the engine then keeps launching step n+1 before it reads step n). False whenever the
        cost_policy is not declining there, and at the step that reaches the reprobe count (score_now probes there)."""
        if not self._declining.get(batch):
            return False
        declined = self._declined.get(batch, 0) + 1
        if declined >= self._reprobe.get(batch, self.reprobe_after):
            return False
        self._declined[batch] = declined
        return True

    def describe(self) -> dict[str, dict[str, float]]:
        """Measured step times (ms) by batch size (keys as strings, as JSON keeps them), for reports."""
        return {"verify_ms": {str(b): 1e3 * s for b, s in sorted(self.score_s.items())},
                "decode_ms": {str(b): 1e3 * s for b, s in sorted(self.decode_s.items())}}
