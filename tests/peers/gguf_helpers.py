"""Helpers of the llama.cpp peer tests."""

from __future__ import annotations

import sys
from typing import Any

from k3verify.peers.llamacpp import LlamaCpp


def gguf_module(llamacpp: LlamaCpp) -> Any:
    """The tree's own gguf-py, imported without leaving its folder on sys.path (it holds a `tests` package)."""
    path = str(llamacpp.tree / "gguf-py")
    sys.path.insert(0, path)
    try:
        import gguf
    finally:
        sys.path.remove(path)
    return gguf
