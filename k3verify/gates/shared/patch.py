"""A control's deliberate fault, in place for one block: `patched` replaces one attribute and restores exactly
what the object held itself; `patched_all` does it on several objects."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def patched(obj: Any, attr: str, value: Any) -> Iterator[None]:
    """Temporarily replace `obj.attr` (a control's deliberate fault). Restores exactly what `obj` held
    itself: an attribute it only inherited (a method) is deleted again, never pinned as a bound copy
    that would shadow later class-level patches."""
    had_own = attr in (vars(obj) if hasattr(obj, "__dict__") else {})
    if isinstance(obj, torch.nn.Module):  # parameters, buffers and children live outside __dict__
        had_own = had_own or any(attr in d for d in (obj._parameters, obj._buffers, obj._modules))
    old = getattr(obj, attr) if had_own else None
    setattr(obj, attr, value)
    try:
        yield
    finally:
        if had_own:
            setattr(obj, attr, old)
        else:
            delattr(obj, attr)


@contextlib.contextmanager
def patched_all(objs: list[Any], name: str, value: Any) -> Iterator[None]:
    """`patched` on every object of `objs` for the block."""
    with contextlib.ExitStack() as stack:
        for obj in objs:
            stack.enter_context(patched(obj, name, value))
        yield
