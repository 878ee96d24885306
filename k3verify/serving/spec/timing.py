"""The plain decode step's time as the cost gate (policy.CostGate) needs it: what the step costs when steps are
launched ahead, not what the in-order step that measures it costs.

The gate weighs a verify step against the plain step that would run instead, and when it declines, plain steps
run launch-ahead (offline._plain_tail, the engine's launch-ahead loop): step n+1 is launched before step n's ids
are read back, so the host's round trip and bookkeeping overlap the device. The plain steps the gate can time run
in order (the drafter needs their tokens on the host), and their wall time carries that round trip: on the H200
(kl-48b-8l, batch 1) 1.6 ms a step in order (docs/results/h200-2026-12-03b, spec.json's cost_gate) against 1.19
ms launch-ahead (docs/results/h200-2026-12-03), enough for the gate to keep verifying at 0% acceptance. So on
CUDA the step is timed on the device, between an event recorded before its launch and one recorded after it.
That interval still holds this step's input fill and launch whenever the device waits for them (an idle device
reaches the start event at once), which a launch-ahead step hides behind the step before; with graphs that is a
short stretch of host work (not measured separately), against the whole round trip the wall clock adds. On the
CPU every launch runs to completion, so launch-ahead saves no time there and the wall clock around the step is
what it costs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class StepTimer:
    """Started at construction, right before the step's first launch; `launched()` right after its last launch,
    before the readback; `seconds()` after the readback (on the CPU the step's span ends there: the readback and
    the host's work on the step are paid in order there, launch-ahead or not)."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"StepTimer times steps on cuda (events) or cpu (wall clock); got device {device}")
        self._clock, self._stopped = clock, False
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._start = 0.0
        if device.type == "cuda":
            self._stream = torch.cuda.current_stream(device)
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record(self._stream)
        else:
            self._start = clock()

    def launched(self) -> None:
        """The step's work is all issued."""
        self._stopped = True
        if self._events is not None:
            self._events[1].record(self._stream)

    def seconds(self) -> float:
        """The step's time. On CUDA the end event is waited for: a readback issued inside the launch (the engine's)
        waited only for its own copy, which runs before this event."""
        if not self._stopped:
            raise RuntimeError("StepTimer.seconds() before launched(): the step's end was never marked")
        if self._events is None:
            return self._clock() - self._start
        start, end = self._events
        end.synchronize()
        return start.elapsed_time(end) / 1e3
