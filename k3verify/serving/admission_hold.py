"""The admission hold: requests that arrive together are admitted together.

A prefill pass has a fixed cost that is host work, several times the GPU time of a short prompt, so a burst of
arrivals admitted over two or three steps stalls every running stream two or three times. The waiting queue is
therefore admitted once no request has arrived for ADMIT_QUIET_S, or once its oldest request has waited
ADMIT_MAX_HOLD_S, or at once when the waiting requests fill every free slot; running rows keep decoding meanwhile
(TGI batches prefills for the same reason with its waiting_served_ratio). A server whose last ADMIT_HISTORY
admissions each took one request sees requests come one at a time: it admits at once (a hold there only adds its
quiet time to every request's time to first token). The quiet time sits just above the gaps between the requests
of a burst of clients whose streams end together, the longest hold just above the span of such a burst (the served
bench's bursts: docs/results/README.md).
"""

from __future__ import annotations

import time
from collections import deque

ADMIT_QUIET_S = 0.005
ADMIT_MAX_HOLD_S = 0.040
ADMIT_HISTORY = 4


class AdmissionHold:
    """How long the waiting queue's admission should still wait for more arrivals (see ADMIT_QUIET_S)."""

    def __init__(self, quiet_s: float = ADMIT_QUIET_S, max_hold_s: float = ADMIT_MAX_HOLD_S) -> None:
        if quiet_s < 0 or max_hold_s < 0:
            raise ValueError(f"admission hold times must be >= 0; got {quiet_s}, {max_hold_s}")
        self.quiet_s, self.max_hold_s = quiet_s, max_hold_s
        self.admitted_sizes: deque[int] = deque(maxlen=ADMIT_HISTORY)  # requests per recent admitting step

    def record_admitted(self, num_admitted: int) -> None:
        """One step admitted num_admitted (> 0) requests."""
        self.admitted_sizes.append(num_admitted)

    def seconds(self, num_waiting: int, room: int, oldest_arrival: float, newest_arrival: float,
                now: float | None = None) -> float:
        """Seconds to wait still (0: admit now) for num_waiting requests, room of them admissible now, the oldest
        and newest of them submitted at these monotonic times (now: time.monotonic() unless given)."""
        if not num_waiting or self.quiet_s <= 0:
            return 0.0
        if len(self.admitted_sizes) == ADMIT_HISTORY and max(self.admitted_sizes) == 1:
            return 0.0  # requests come one at a time
        if num_waiting >= room:
            return 0.0
        return max(0.0, min(newest_arrival + self.quiet_s, oldest_arrival + self.max_hold_s)
                   - (time.monotonic() if now is None else now))
