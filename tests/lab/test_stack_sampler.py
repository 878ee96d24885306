"""lab/stack_sampler.py charges a thread's wall time to the functions on its stack, and leaves idle waits out."""

from __future__ import annotations

import threading
import time

from lab.stack_sampler import StackSampler


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def busy_outer() -> None:
    _spin(0.15)


def wait_for_work(event: threading.Event) -> None:
    event.wait(0.15)


def test_busy_time_is_charged_to_its_functions_and_idle_waits_are_left_out() -> None:
    started = threading.Event()

    def work() -> None:
        started.set()
        busy_outer()
        wait_for_work(threading.Event())

    thread = threading.Thread(target=work)
    thread.start()
    started.wait(5)
    assert thread.ident is not None
    with StackSampler(thread.ident, interval_s=0.002, idle=("wait_for_work",)) as sampler:
        thread.join(5)
    busy = [n for n in sampler.inclusive if n.endswith("(busy_outer)")]
    # the spin holds the GIL (samples only at switches): weighting by interval still charges it its ~0.15 s
    assert busy and sampler.inclusive[busy[0]] >= 0.8 * sampler.busy_s, sampler.table(5)
    assert 0.1 < sampler.busy_s < 0.3, sampler.table(5)
    assert any(n.endswith("(_spin)") for n, _ in sampler.most(sampler.exclusive, 1)), sampler.table(5)
    assert sampler.idle_s > 0.05 and not any(n.endswith("(wait_for_work)") for n in sampler.inclusive)
    assert "busy samples" in sampler.table(3)
