"""Where does a piece of CUDA work make the host wait? (the diagnostic scripts' helper)"""

from __future__ import annotations

import collections
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch


def sync_sites(fn: Callable[[], Any], depth: int = 3) -> collections.Counter[str]:
    """Run fn under torch.cuda.set_sync_debug_mode("warn"): each host sync, named by its innermost `depth` frames
    in k3verify or fla ("" when none of them is on the stack). Without CUDA fn just runs: no syncs to see."""
    sites: collections.Counter[str] = collections.Counter()
    if not torch.cuda.is_available():
        fn()
        return sites

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
        frames = [f for f in traceback.extract_stack()[:-1] if "k3verify" in f.filename or "/fla/" in f.filename]
        sites[" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-depth:][::-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


def _site(frame: Any) -> str:
    """file:line(function) of the innermost frame in k3verify or fla at or above `frame`, else of `frame`."""
    f = frame
    while f is not None and not ("k3verify" in f.f_code.co_filename or "/fla/" in f.f_code.co_filename):
        f = f.f_back
    f = f or frame
    path = f.f_code.co_filename
    for marker in ("/k3verify/", "/fla/"):
        if marker in path:
            path = path[path.index(marker) + 1:]
    return f"{path}:{f.f_lineno}({f.f_code.co_name})"


class LongCalls:
    """Every C call (a torch op, a CUDA runtime wrapper, a lock wait) made from one thread's Python code that held
    the host for longer than `threshold_s`, by call site and callee: `sys.setprofile(calls.hook)` on the thread
    (it is per thread), run, `sys.setprofile(None)`, then `calls.table()`.

    This sees the waits `sync_sites` cannot: torch's sync debug mode flags the syncs torch itself makes
    (`.item()`, `.tolist()`, a blocking copy), but not a copy from pageable host memory with non_blocking=True,
    which the CUDA driver may stage by waiting for the stream. With `spin_s`, a GPU spin kernel of that length
    is queued at `arm()` and again after every long call, so the GPU is always behind the host and every call
    that waits for it shows up as a wait of about `spin_s`, even where the GPU would have been idle."""

    def __init__(self, threshold_s: float = 0.002, spin_s: float = 0.0) -> None:
        self.threshold_s, self.spin_s = threshold_s, spin_s
        self.total_s: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.count: collections.Counter[str] = collections.Counter()
        self.max_s: dict[str, float] = {}
        self._open: list[tuple[Any, float]] = []
        self._cycles = 0

    def arm(self) -> None:
        """Queue one spin of `spin_s` on the current stream (a no-op without spin_s or CUDA)."""
        if self.spin_s <= 0 or not torch.cuda.is_available():
            return
        if not self._cycles:  # calibrate the spin kernel's clock once: cycles per second
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            end.synchronize()
            self._cycles = int(self.spin_s * 10_000_000 / (start.elapsed_time(end) / 1e3))
        torch.cuda._sleep(self._cycles)

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_call":
            self._open.append((frame, time.perf_counter()))
        elif event in ("c_return", "c_exception") and self._open:
            caller, t0 = self._open.pop()
            took = time.perf_counter() - t0
            if took >= self.threshold_s:
                key = f"{_site(caller)} -> {getattr(arg, '__qualname__', None) or getattr(arg, '__name__', arg)}"
                self.total_s[key] += took
                self.count[key] += 1
                self.max_s[key] = max(self.max_s.get(key, 0.0), took)
                self.arm()

    def table(self, n: int = 25) -> str:
        behind = f"; GPU kept {1e3 * self.spin_s:g} ms behind" if self.spin_s else ""
        lines = [f"{'calls':>6} {'total ms':>9} {'max ms':>8}  call site -> callee (C calls over "
                 f"{1e3 * self.threshold_s:g} ms{behind})"]
        for key, total in sorted(self.total_s.items(), key=lambda kv: -kv[1])[:n]:
            lines.append(f"{self.count[key]:>6} {1e3 * total:>9.1f} {1e3 * self.max_s[key]:>8.1f}  {key}")
        if len(lines) == 1:
            lines.append("(none)")
        return "\n".join(lines)
