"""Where does a piece of CUDA work make the host wait? (the diagnostic scripts' helper)"""

from __future__ import annotations

import collections
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch


def sync_sites(fn: Callable[[], Any], depth: int = 3) -> collections.Counter[str]:
    """Run fn under torch.cuda.set_sync_debug_mode("warn"): each host sync, named by its innermost `depth` frames
    in k3verify or fla ("" when none of them is on the stack). Without CUDA fn just runs: no syncs to see."""
    sites: collections.Counter[str] = collections.Counter()
    if not torch.cuda.is_available():
        fn()
        return sites

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
        frames = [f for f in traceback.extract_stack()[:-1] if "k3verify" in f.filename or "/fla/" in f.filename]
        sites[" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-depth:][::-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites
