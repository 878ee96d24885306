"""One registry for every op that has more than one implementation.

Each op has a torch reference (runs anywhere) and optionally a fast path for CUDA (fla / Triton).
`dispatch` picks the fast path on CUDA when it is available and accepts the call; when it refuses,
the reason is LOGGED as a warning and the torch reference runs — never silently. Every call records
which backend ran (`last_backend`, `counts`), which is what the routing tests assert on.
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
        reason = fast.available() if fast.available is not None else None
        if reason is None and fast.accepts is not None:
            reason = fast.accepts(*args, **kwargs)
        if reason is None:
            return fast
        log.warning("kernel %s: fast path refused, falling back to torch: %s", op, reason)
        self.fallbacks.append((op, reason))
        return impls[TORCH]

    def call(self, op: str, *args: Any, device: torch.device, **kwargs: Any) -> Any:
        impl = self.select(op, device, *args, **kwargs)
        self.last_backend[op] = impl.backend
        self.counts[(op, impl.backend)] += 1
        return impl.fn(*args, **kwargs)


REGISTRY = KernelRegistry()


def dispatch(op: str, *args: Any, device: torch.device, **kwargs: Any) -> Any:
    """Run `op` on the backend the global registry picks for `device`."""
    _ensure_loaded()
    return REGISTRY.call(op, *args, device=device, **kwargs)


_LOADED = False


def _ensure_loaded() -> None:
    """Import the op packages once so they register (kept lazy to avoid import cycles)."""
    global _LOADED
    if _LOADED:
        return
    from k3verify.kernels import conv, kda, moe, mxfp4, norm  # noqa: F401

    _LOADED = True
