"""Per-request auto-off: speculation stops for a request whose drafts keep being rejected.

A verify pass costs more than a decode step (k+1 rows through every layer, more distinct experts per MoE
layer), so a request that gains nothing from it should decode plainly. Rule: after `min_verifies` verify
steps, and after every later one, if the request's accepted drafts per verify step (over all its verify
steps so far) fall below `min_mean_accepted`, that request decodes without speculation until it finishes.
At 0% acceptance this costs exactly `min_verifies` verify steps per request; min_mean_accepted=0 turns
the rule off.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    verifies: int = 0
    drafted: int = 0
    accepted: int = 0
    off: bool = False


@dataclass(frozen=True)
class SpecPolicy:
    min_verifies: int = 3
    min_mean_accepted: float = 0.25

    def __post_init__(self) -> None:
        if self.min_verifies < 1 or self.min_mean_accepted < 0:
            raise ValueError(f"min_verifies must be >= 1 and min_mean_accepted >= 0; got {self.min_verifies}, "
                             f"{self.min_mean_accepted}")

    def record(self, stats: SpecStats, drafted: int, accepted: int) -> int:
        """One verify of `drafted` countable drafts (offline.useful_drafts) that accepted `accepted` positions;
        what was accepted past the countable drafts is not counted. Returns the accepted count recorded."""
        accepted = min(accepted, drafted)
        stats.verifies += 1
        stats.drafted += drafted
        stats.accepted += accepted
        if stats.verifies >= self.min_verifies and stats.accepted < self.min_mean_accepted * stats.verifies:
            stats.off = True
        return accepted
