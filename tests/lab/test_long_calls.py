"""lab/host_syncs.LongCalls names the C calls that held a thread past its threshold, by call site and callee,
and leaves short ones out (the probe that found the pageable-copy waits of a served prefill step)."""

from __future__ import annotations

import sys
import time

from lab.host_syncs import LongCalls


def _held() -> None:
    time.sleep(0.02)  # a C call that holds the thread (as a stream wait would)


def _quick() -> None:
    for _ in range(200):
        len("x")


def test_long_calls_are_named_by_site_and_short_ones_left_out() -> None:
    calls = LongCalls(threshold_s=0.01)
    sys.setprofile(calls.hook)
    try:
        _held()
        _quick()
        _held()
    finally:
        sys.setprofile(None)
    keys = list(calls.total_s)
    assert len(keys) == 1, keys  # len() never crosses 10 ms
    assert "sleep" in keys[0] and calls.count[keys[0]] == 2, keys
    assert calls.total_s[keys[0]] >= 0.04 and calls.max_s[keys[0]] >= 0.02
    table = calls.table()
    assert "sleep" in table and "2" in table.splitlines()[1]


def test_nothing_over_the_threshold_says_none() -> None:
    calls = LongCalls(threshold_s=1.0)
    sys.setprofile(calls.hook)
    try:
        _quick()
    finally:
        sys.setprofile(None)
    assert calls.table().splitlines()[-1] == "(none)"
