"""Say on the console when Triton compiles a kernel, and what the compiling has cost so far.

A first run on a card compiles every Triton kernel it uses (ours and fla's) and autotunes fla's: minutes at real
size, with nothing on the screen. `watch_compiles()` installs Triton's JIT hooks (the one before a compile and
the one after it) so that each kernel whose compile takes longer than a disk-cache read gets one line on stderr the
first time, with the count and the seconds so far; a process that compiled anything says at exit how many kernels
took how long and where Triton keeps them for the next run. Nothing is said on a warm cache. What is left to
compile is not known before Triton is asked for it, so the lines say what has been done, not what remains.

The hooks only observe: the pre-compile hook returns False (a true value would make Triton skip the compile), and
hooks installed before ours are called as they were.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A compile that finds its kernel in Triton's on-disk cache takes milliseconds; one that compiles takes seconds.
SLOW_COMPILE_S = 0.3
WATCH_ENV = "K3V_COMPILE_NOTICES"  # 0: install nothing


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels (and autotune picks, with TRITON_CACHE_AUTOTUNING)."""
    return os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")


class CompileWatch:
    """Times each JIT compile between Triton's two hooks; says the slow ones, once per kernel function."""

    def __init__(self, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.say = say
        self.clock = clock
        self.started: dict[tuple[str, str], float] = {}
        self.named: set[str] = set()
        self.compiles = 0
        self.seconds = 0.0
        self.lock = threading.Lock()

    def before(self, **kwargs: Any) -> bool:
        """Triton's pre-compile hook (keywords key, fn, ...): never raises, whatever a Triton version passes."""
        try:
            with self.lock:
                self.started[(_name(kwargs.get("fn")), repr(kwargs.get("key")))] = self.clock()
        except Exception:  # a notice must never stop a compile
            pass
        return False  # compile: a true value would make Triton skip it

    def after(self, **kwargs: Any) -> None:
        """Triton's post-compile hook: never raises."""
        try:
            self._after(kwargs.get("key"), kwargs.get("fn"))
        except Exception:  # a notice must never fail a compile that succeeded
            pass

    def _after(self, key: Any, fn: Any) -> None:
        name = _name(fn)
        with self.lock:
            start = self.started.pop((name, repr(key)), None)
            if start is None:
                return
            took = self.clock() - start
            if took < SLOW_COMPILE_S:
                return
            self.compiles += 1
            self.seconds += took
            first = name not in self.named
            self.named.add(name)
            count, total = self.compiles, self.seconds
        if first:
            self.say(f"[triton] compiled {name} in {took:.1f} s ({count} compile(s), {total:.0f} s so far; a "
                     f"first run on this card, later runs read {triton_cache_dir()})")

    def say_summary(self) -> None:
        line = self.summary()
        if line is not None:
            with contextlib.suppress(Exception):  # at exit, stderr may be gone
                self.say(line)

    def summary(self) -> str | None:
        if not self.compiles:
            return None
        return (f"[triton] {self.compiles} compile(s) of {len(self.named)} kernel(s) took {self.seconds:.0f} s; "
                f"kept in {triton_cache_dir()} for the next run on this card")


def _name(fn: Any) -> str:
    return str(getattr(fn, "name", None) or getattr(fn, "__name__", None) or fn)


def _chain(first: Callable[..., Any] | None, second: Callable[..., Any]) -> Callable[..., Any]:
    """`second` after an earlier hook; the earlier hook's answer is kept (a True from it still skips the compile)."""
    if first is None:
        return second

    def both(**kwargs: Any) -> Any:
        answer = first(**kwargs)
        second(**kwargs)
        return answer
    return both


_WATCH: CompileWatch | None = None


def watch_compiles(say: Callable[[str], None] | None = None) -> CompileWatch | None:
    """Install the watch once per process (None where Triton or its hooks are missing, or K3V_COMPILE_NOTICES=0)."""
    global _WATCH
    if _WATCH is not None or os.environ.get(WATCH_ENV) == "0":
        return _WATCH
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = knobs.runtime
    if not (hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook")):
        return None
    watch = CompileWatch(say or (lambda line: print(line, file=sys.stderr, flush=True)))
    runtime.jit_cache_hook = _chain(runtime.jit_cache_hook, watch.before)
    runtime.jit_post_compile_hook = _chain(runtime.jit_post_compile_hook, watch.after)
    atexit.register(watch.say_summary)
    _WATCH = watch
    return watch
