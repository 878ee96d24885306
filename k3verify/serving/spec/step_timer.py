"""The plain decode step's time as the cost policy (policy.CostPolicy) needs it: what the step costs when steps are
launched ahead, not what the in-order step that measures it costs.

The cost policy weighs a score step against the plain step that would run instead, and when it declines, plain steps
run launch-ahead (offline._plain_tail, the engine's launch-ahead loop): step n+1 is launched before step n's ids
are read back, so the host's round trip and bookkeeping overlap the device. The plain steps the cost policy can time run
in order (the drafter needs their tokens on the host), and their wall time carries that round trip: a plain step
timed so looks costly enough for the cost policy to keep scoring at 0% acceptance. So on CUDA the step is timed on
the device, between an event recorded before its launch and one recorded after it. An event recorded before the
launch still counts the step's input fill and launch, which an idle device waits for and a launch-ahead step hides
behind the step before, and that alone can still tip the cost policy into scoring at 0% acceptance. So where the
step runs through a GraphDecoder, `starting_at_replay` moves the start to right before the graph's replay, its
inputs filled: the interval is then the replay's device time (plus the sampling an engine step launches behind
it), which is what a launch-ahead step costs while the host keeps ahead of the device, as it does in the bench's
steady state (the measured times: docs/results/README.md). Where the host falls behind, a
launch-ahead step costs more than this: the cost policy then leans towards scoring. On the CPU every launch runs to
completion, so launch-ahead saves no time there and the wall clock around the step is what it costs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from k3verify.serving.graphs import GraphDecoder


class StepTimer:
    """Started at construction, right before the step's first launch (`restart()` moves the start on CUDA, as
    `starting_at_replay` does at the replay); `launched()` right after its last launch, before the readback;
    `seconds()` after the readback (on the CPU the step's span ends there: the readback and the host's work on the
    step are paid in order there, launch-ahead or not)."""

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

    def restart(self) -> None:
        """On CUDA, the step's time starts here (the start event recorded again); on the CPU the span keeps its
        start (there the host's work before the launch is part of what a step costs)."""
        if self._events is not None:
            self._events[0].record(self._stream)

    @contextlib.contextmanager
    def starting_at_replay(self, graphs: GraphDecoder | None) -> Iterator[None]:
        """Inside: a step through `graphs` restarts this timer right before its replay (the fill and launch
        before it are not timed); the graphs' hook is cleared on the way out, whatever happens inside."""
        if graphs is None:
            yield
            return
        if graphs.before_replay is not None:
            raise RuntimeError("the graphs' before_replay hook is already set: two timers on one step")
        graphs.before_replay = self.restart
        try:
            yield
        finally:
            graphs.before_replay = None

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
