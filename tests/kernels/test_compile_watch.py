"""The compile notices: a compile that takes seconds is said once per kernel with the count and time so far, a
disk-cache read says nothing, the hooks never ask Triton to skip a compile, and hooks installed before ours keep
working. (Triton's JIT only compiles on a GPU: here the hooks are called as Triton calls them, by keyword.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from k3verify.kernels import compile_watch
from k3verify.kernels.compile_watch import SLOW_COMPILE_S, CompileWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _compile(watch: CompileWatch, clock: Clock, name: str, key: Any, seconds: float) -> bool:
    fn = SimpleNamespace(name=name)
    skip = watch.before(key=key, repr=f"{name}(...)", fn=fn, compile={}, is_manual_warmup=False,
                        already_compiled=False)
    clock.now += seconds
    watch.after(key=key, repr=f"{name}(...)", fn=fn, compile={}, is_manual_warmup=False, already_compiled=False)
    return skip


def test_slow_compiles_are_said_once_per_kernel_and_counted() -> None:
    said: list[str] = []
    clock = Clock()
    watch = CompileWatch(said.append, clock)
    assert _compile(watch, clock, "chunk_kda_fwd", ("k", 1), SLOW_COMPILE_S / 10) is False  # a disk-cache read
    assert said == [] and watch.summary() is None
    assert _compile(watch, clock, "chunk_kda_fwd", ("k", 2), 4.0) is False
    assert _compile(watch, clock, "chunk_kda_fwd", ("k", 3), 2.0) is False  # an autotune config of the same kernel
    assert _compile(watch, clock, "moe_decode", ("k", 1), 1.5) is False
    assert len(said) == 2, said
    assert said[0].startswith("[triton] compiled chunk_kda_fwd in 4.0 s (1 compile(s), 4 s so far")
    assert said[1].startswith("[triton] compiled moe_decode in 1.5 s (3 compile(s), 8 s so far")
    summary = watch.summary()
    assert summary is not None and summary.startswith("[triton] 3 compile(s) of 2 kernel(s) took 8 s")


def test_an_after_without_its_before_is_ignored() -> None:
    said: list[str] = []
    watch = CompileWatch(said.append, Clock())
    watch.after(key=1, fn=SimpleNamespace(name="k"))
    assert said == [] and watch.summary() is None


def test_the_hooks_install_once_and_keep_an_earlier_hook_s_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    knobs = pytest.importorskip("triton").knobs
    calls: list[str] = []

    def earlier(**kwargs: Any) -> bool:
        calls.append("earlier")
        return True  # an earlier hook that skips compiles keeps doing so

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", earlier)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(compile_watch, "_WATCH", None)
    monkeypatch.delenv(compile_watch.WATCH_ENV, raising=False)
    said: list[str] = []
    watch = compile_watch.watch_compiles(said.append)
    assert watch is not None and compile_watch.watch_compiles(said.append) is watch
    fn = SimpleNamespace(name="kern")
    assert knobs.runtime.jit_cache_hook(key=1, fn=fn, repr="", compile={}, is_manual_warmup=False,
                                        already_compiled=False) is True
    assert calls == ["earlier"] and (fn.name, "1") in watch.started


def test_notices_off(monkeypatch: pytest.MonkeyPatch) -> None:
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(compile_watch, "_WATCH", None)
    monkeypatch.setenv(compile_watch.WATCH_ENV, "0")
    assert compile_watch.watch_compiles() is None
    assert knobs.runtime.jit_cache_hook is None


def test_a_hook_called_with_other_keywords_or_a_failing_say_never_raises() -> None:
    """Another Triton version may pass other keywords; a console that fails must not fail the compile."""
    clock = Clock()

    def broken_say(line: str) -> None:
        raise OSError("stderr closed")

    watch = CompileWatch(broken_say, clock)
    assert watch.before() is False and watch.before(unexpected=1) is False
    watch.after()
    assert _compile(watch, clock, "k", 1, 5.0) is False  # the say raises inside: swallowed
    assert watch.compiles == 1
