"""One registry for every op that has more than one implementation.

Each op has a torch reference (runs anywhere) and optionally a fast path for CUDA (fla / Triton).
`dispatch` picks the fast path on CUDA when it is available and accepts the call; when it refuses,
the reason is LOGGED as a warning (once per op and reason; every refusal is counted in `fallbacks`)
and the torch reference runs — never silently. A fast path that raises (a Triton kernel that does
not compile on this GPU's toolchain, say) is disabled for the process with a logged warning naming
the exception, except during CUDA-graph capture, where the error propagates. Every call records
which backend ran (`last_backend`, `counts`), which is what the routing tests assert on.

This module imports no op: each op package registers its implementations when imported, and
`k3verify/kernels/__init__.py` imports them all, so any import of this module (which runs the package's
`__init__` first) finds every op registered.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("k3verify.kernels")

TORCH = "torch"
TRITON = "triton"
CUDA = "cuda"  # a CUDA-only torch path (e.g. torch._grouped_mm), not Triton
FAST_BACKENDS = (TRITON, CUDA)

# A fast path's gate: None = accepted, else a human-readable refusal reason.
Acceptor = Callable[..., str | None]


@dataclass(frozen=True)
class Impl:
    op: str
    backend: str
    fn: Callable[..., Any]
    accepts: Acceptor | None = None
    available: Callable[[], str | None] | None = None  # None = available, else why not


class KernelRegistry:
    def __init__(self) -> None:
        self._impls: dict[str, dict[str, Impl]] = {}
        self.last_backend: dict[str, str] = {}
        self.counts: Counter[tuple[str, str]] = Counter()
        self.fallbacks: list[tuple[str, str]] = []  # (op, reason), newest last
        self._forced: dict[str, str] = {}
        self._warned: set[tuple[str, str]] = set()
        self._broken: dict[tuple[str, str], str] = {}  # (op, backend) -> why it was disabled

    def register(self, op: str, backend: str, fn: Callable[..., Any], *, accepts: Acceptor | None = None,
                 available: Callable[[], str | None] | None = None) -> None:
        if backend not in (TORCH, *FAST_BACKENDS):
            raise ValueError(f"unknown backend {backend!r} for op {op!r}; expected one of {(TORCH, *FAST_BACKENDS)}")
        if backend in FAST_BACKENDS and any(b in self._impls.get(op, {}) for b in FAST_BACKENDS if b != backend):
            raise ValueError(f"op {op!r} already has a fast path; one fast backend per op keeps routing unambiguous")
        self._impls.setdefault(op, {})[backend] = Impl(op, backend, fn, accepts, available)

    def ops(self) -> list[str]:
        return sorted(self._impls)

    def backends(self, op: str) -> list[str]:
        return sorted(self._impls.get(op, {}))

    def force(self, op: str, backend: str | None) -> None:
        """Pin an op to one backend (tests, benchmarks). None removes the pin."""
        if backend is None:
            self._forced.pop(op, None)
            return
        if backend not in self._impls.get(op, {}):
            raise ValueError(f"op {op!r} has no {backend!r} implementation; has {self.backends(op)}")
        self._forced[op] = backend

    def select(self, op: str, device: torch.device, *args: Any, **kwargs: Any) -> Impl:
        impls = self._impls.get(op)
        if not impls or TORCH not in impls:
            raise KeyError(f"op {op!r} is not registered with a torch reference; registered: {self.ops()}")
        forced = self._forced.get(op)
        if forced is not None:
            return impls[forced]
        fast = next((impls[b] for b in FAST_BACKENDS if b in impls), None)
        if device.type != "cuda" or fast is None:
            return impls[TORCH]
        reason = self._broken.get((op, fast.backend))
        if reason is None and fast.available is not None:
            reason = fast.available()
        if reason is None and fast.accepts is not None:
            reason = fast.accepts(*args, **kwargs)
        if reason is None:
            return fast
        self._refused(op, reason)
        return impls[TORCH]

    def _refused(self, op: str, reason: str, instead: str = "torch") -> None:
        if (op, reason) not in self._warned:
            self._warned.add((op, reason))
            log.warning("kernel %s: fast path refused, falling back to %s: %s", op, instead, reason)
        self.fallbacks.append((op, reason))

    def refused_inside(self, op: str, path: str, reason: str, instead: str) -> None:
        """A fast path's own choice between two kernels: `path` refused the call and `instead` runs (warned once
        per reason, counted in `fallbacks` like a registry refusal)."""
        self._refused(op, f"{path}: {reason}", instead)

    def broken_inside(self, op: str, path: str) -> str | None:
        return self._broken.get((op, path))

    def run_inside(self, op: str, path: str, refusal: str | None, fn: Callable[[], Any], instead: str) -> Any | None:
        """A fast path's own kernel choice: fn() (kernel path `path` of `op`) unless `refusal` says why not or the
        path was disabled; a raise outside CUDA-graph capture disables it for the process, as `call` disables a
        backend. None after the refusal was logged (once per reason, counted in `fallbacks`): the caller runs
        `instead`. fn must not return None."""
        reason = self.broken_inside(op, path) or refusal
        if reason is None:
            try:
                return fn()
            except Exception as exc:
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                reason = f"raised {type(exc).__name__}: {exc}; disabled for this process"
                self._broken[(op, path)] = reason
        self.refused_inside(op, path, reason, instead)
        return None

    def call(self, op: str, *args: Any, device: torch.device, **kwargs: Any) -> Any:
        impl = self.select(op, device, *args, **kwargs)
        self.last_backend[op] = impl.backend
        self.counts[(op, impl.backend)] += 1
        if impl.backend == TORCH:
            return impl.fn(*args, **kwargs)
        try:
            return impl.fn(*args, **kwargs)
        except Exception as exc:
            if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            reason = f"{impl.backend} path raised {type(exc).__name__}: {exc}; disabled for this process"
            self._broken[(op, impl.backend)] = reason
            self._refused(op, reason)
            torch_impl = self._impls[op][TORCH]
            self.last_backend[op] = TORCH
            self.counts[(op, TORCH)] += 1
            return torch_impl.fn(*args, **kwargs)


REGISTRY = KernelRegistry()


def dispatch(op: str, *args: Any, device: torch.device, **kwargs: Any) -> Any:
    """Run `op` on the backend the global registry picks for `device`."""
    return REGISTRY.call(op, *args, device=device, **kwargs)
