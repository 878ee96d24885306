"""Start the ranks of a world on this host: torch.multiprocessing (spawn), one process per rank, a
rendezvous file in a private temp folder. A rank that raises makes the launcher raise with its traceback;
the others are terminated."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

INIT_FILE = "rendezvous"


def rendezvous_file(folder: str) -> str:
    return os.path.join(folder, INIT_FILE)


def spawn_world(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Run `fn(rank, init_file, *args)` in `world` fresh processes (rank 0 .. world-1) and wait for all of
    them; `fn` must be a module-level function (spawn pickles it by name)."""
    if world < 1:
        raise ValueError(f"a world needs at least one rank; got {world}")
    folder = tempfile.mkdtemp(prefix="k3v-world-")
    mp.start_processes(fn, args=(rendezvous_file(folder), *args), nprocs=world, join=True, start_method="spawn")
