"""Engine health as the operator sees it: ok, degraded (still serving) or unhealthy (503), with counts.

Two kinds of trouble are counted: engine restarts (the supervisor brought a dead loop back with fresh
caches) and requests failed by non-finite logits. Either, within the last `window_s`, makes the engine
degraded; `max_nonfinite` such failures within the window make it unhealthy (a model that keeps
producing NaN should be taken out of rotation), and more than `max_restarts` restarts within the window
make the supervisor give up (the loop stays dead, which is unhealthy by itself).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

State = Literal["ok", "degraded", "unhealthy"]


@dataclass(frozen=True)
class HealthPolicy:
    """The operator's thresholds (`serve --nonfinite-threshold`, `--max-restarts`, `--health-window`)."""

    max_nonfinite: int = 8
    max_restarts: int = 5
    window_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_nonfinite < 1 or self.max_restarts < 0 or not self.window_s > 0:
            raise ValueError(f"health policy needs max_nonfinite >= 1, max_restarts >= 0, window_s > 0; got {self}")


@dataclass(frozen=True)
class HealthStatus:
    state: State
    reasons: tuple[str, ...]
    restarts: int  # since start
    nonfinite_failures: int  # since start

    def as_dict(self) -> dict[str, object]:
        return {"status": self.state, "reasons": list(self.reasons), "restarts": self.restarts,
                "nonfinite_failures": self.nonfinite_failures}


@dataclass
class EngineHealth:
    """Counts and recent-event windows; updated on the engine thread, read from HTTP threads."""

    policy: HealthPolicy = field(default_factory=HealthPolicy)
    clock: Callable[[], float] = time.monotonic
    restarts: int = 0
    nonfinite_failures: int = 0
    last_restart_reason: str | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._restart_times: deque[float] = deque()
        self._nonfinite_times: deque[float] = deque()

    def _recent(self, times: deque[float]) -> int:
        horizon = self.clock() - self.policy.window_s
        while times and times[0] < horizon:
            times.popleft()
        return len(times)

    def record_restart(self, reason: str) -> bool:
        """Count a loop failure; False when it is one more than max_restarts within the window (give up)."""
        with self._lock:
            self._restart_times.append(self.clock())
            if self._recent(self._restart_times) > self.policy.max_restarts:
                return False
            self.restarts += 1
            self.last_restart_reason = reason
            return True

    def record_process_restarts(self, count: int, reason: str) -> None:
        """Count restarts of the engine's process (a fresh process, so a fresh tracker): the latest is recent."""
        with self._lock:
            self.restarts += count
            self.last_restart_reason = reason
            self._restart_times.append(self.clock())

    def record_nonfinite(self) -> None:
        with self._lock:
            self.nonfinite_failures += 1
            self._nonfinite_times.append(self.clock())

    def status(self, loop_error: str | None) -> HealthStatus:
        """The state given the loop's own condition (None: running; else why it is dead or stalled)."""
        with self._lock:
            restarts, nonfinite = self._recent(self._restart_times), self._recent(self._nonfinite_times)
            reasons: list[str] = []
            if loop_error is not None:
                reasons.append(loop_error)
            if nonfinite >= self.policy.max_nonfinite:
                reasons.append(f"{nonfinite} requests failed with non-finite logits in the last "
                               f"{self.policy.window_s:g}s (threshold {self.policy.max_nonfinite})")
            state: State = "unhealthy" if reasons else "ok"
            if state == "ok" and nonfinite:
                reasons.append(f"{nonfinite} request(s) failed with non-finite logits in the last "
                               f"{self.policy.window_s:g}s")
            if state == "ok" and restarts:
                reasons.append(f"engine restarted {restarts} time(s) in the last {self.policy.window_s:g}s "
                               f"(last: {self.last_restart_reason})")
            if state == "ok" and reasons:
                state = "degraded"
            return HealthStatus(state, tuple(reasons), self.restarts, self.nonfinite_failures)
