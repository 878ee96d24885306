"""Lazy loading of a Triton kernel module: importing k3verify never imports triton, and a fast path
whose kernels cannot load says why (the registry logs it and runs the torch reference)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType

import torch

Loader = Callable[[], ModuleType | str]


def lazy_module(module: str, what: str) -> Loader:
    """load() -> the imported module, or the reason it failed to import (cached either way)."""

    @functools.cache
    def load() -> ModuleType | str:
        try:
            return importlib.import_module(module)
        except Exception as exc:  # ImportError, or triton failing to initialise
            return f"{what} unavailable: {type(exc).__name__}: {exc}"

    return load


def cuda_reason(load: Loader) -> str | None:
    """None when CUDA is present and the kernels load, else why not (a fast path's `available`)."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    mod = load()
    return mod if isinstance(mod, str) else None


def loaded(load: Loader) -> ModuleType:
    """The kernel module, or RuntimeError with the import failure (callers checked `cuda_reason` first, so
    this only fires when a launch bypasses the registry's gate)."""
    mod = load()
    if isinstance(mod, str):
        raise RuntimeError(mod)
    return mod
