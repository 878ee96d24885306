"""The CI work order defers tests/peers/ units while the llama.cpp build has not ended."""

from __future__ import annotations

from collections import OrderedDict

from build_order import defer_build_waiters


def queue() -> OrderedDict[str, dict[str, bool]]:
    return OrderedDict([
        ("peers", {"tests/peers/test_a.py::test_x@peers": False, "tests/peers/test_b.py::test_y@peers": False}),
        ("peers-k3", {"tests/peers/test_c.py::test_z@peers-k3": False}),
        ("tests/gates/test_g.py", {"tests/gates/test_g.py::test_1@tests/gates/test_g.py": False}),
        ("tests/api/test_h.py", {"tests/api/test_h.py::test_2@tests/api/test_h.py": False}),
    ])


def test_a_pending_build_sends_the_first_unit_outside_peers_first() -> None:
    q = queue()
    defer_build_waiters(q, build_done=False)
    assert list(q) == ["tests/gates/test_g.py", "peers", "peers-k3", "tests/api/test_h.py"]
    q.popitem(last=False)
    defer_build_waiters(q, build_done=False)
    assert list(q) == ["tests/api/test_h.py", "peers", "peers-k3"]


def test_a_finished_build_or_only_peers_left_keeps_the_order() -> None:
    q = queue()
    defer_build_waiters(q, build_done=True)
    assert list(q)[0] == "peers"
    only = OrderedDict((k, v) for k, v in queue().items() if k.startswith("peers"))
    defer_build_waiters(only, build_done=False)
    assert list(only) == ["peers", "peers-k3"]
