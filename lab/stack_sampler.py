"""Where one thread's wall time goes, by sampling its Python stack (a diagnostic for the served engine thread).

cProfile cannot answer that on Python 3.12: it runs on sys.monitoring, profiles every thread of the process at
once and nests their frames into one another, so a busy engine thread beside the engine link's threads came out
with recursive call counts and cumulative times longer than the run. A sampler
thread reads `sys._current_frames()[ident]` every `interval_s` and counts, for each function on the stack, the
time it was on the stack (inclusive) and on top of it (exclusive). Time spent inside a C call (a CUDA
synchronize, a lock wait, a kernel launch) is charged to the Python function that made it. The sampler needs the
GIL to look, so while the sampled thread holds it samples come only at GIL switches: each sample is therefore
weighted by the time since the previous one (the stack it sees is charged with that interval), or busy Python
would be under-counted against waits.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from types import FrameType


def _name(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    for marker in ("/k3verify/", "/site-packages/", "/python3."):
        if marker in path:
            path = path[path.index(marker) + 1:]
            break
    return f"{path}:{code.co_firstlineno}({code.co_name})"


class StackSampler:
    """`with StackSampler(thread_ident) as s: ...` then `s.table(n)`."""

    def __init__(self, ident: int, interval_s: float = 0.001, idle: tuple[str, ...] = ()) -> None:
        """`idle`: function names that, anywhere on the stack, mean the thread is waiting for work (the engine's
        `_handle_commands`): such samples are counted apart and left out of the tables."""
        self.ident, self.interval_s, self.idle_names = ident, interval_s, idle
        self.samples = 0
        self.busy_s = self.idle_s = 0.0
        self.inclusive: defaultdict[str, float] = defaultdict(float)  # seconds on the stack, by function
        self.exclusive: defaultdict[str, float] = defaultdict(float)  # seconds on top
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k3verify-stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.ident)
            now = time.perf_counter()
            weight, last = now - last, now
            if frame is None:
                continue
            stack: list[FrameType] = []
            while frame is not None:
                stack.append(frame)
                frame = frame.f_back
            if any(f.f_code.co_name in self.idle_names for f in stack):
                self.idle_s += weight
                continue
            self.samples += 1
            self.busy_s += weight
            self.exclusive[_name(stack[0])] += weight
            for name in {_name(f) for f in stack}:  # recursion counts once per sample
                self.inclusive[name] += weight

    @staticmethod
    def most(times: dict[str, float], n: int) -> list[tuple[str, float]]:
        return sorted(times.items(), key=lambda kv: -kv[1])[:n]

    def table(self, n: int = 25) -> str:
        """The n functions with the most inclusive time, and the n with the most exclusive, as % of busy time."""
        if not self.samples:
            return "no busy samples (the thread was not found, or only waited)"
        lines = [f"{self.samples} busy samples every {1e3 * self.interval_s:g} ms or more: {self.busy_s:.2f} s busy, "
                 f"{self.idle_s:.2f} s idle left out"]
        for title, times in (("on the stack (inclusive)", self.inclusive), ("on top (exclusive)", self.exclusive)):
            lines.append(f"-- {title}")
            lines += [f"{100 * t / self.busy_s:6.1f}%  {name}" for name, t in self.most(times, n)]
        return "\n".join(lines)
