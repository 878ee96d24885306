"""Say it before allocating: a GPU workflow compares its planned peak with the memory of the card it is on (read
from the device) and refuses with the sizes and what to try, instead of a traceback from the allocator."""

from __future__ import annotations

import os

import torch

from k3verify.config import ModelConfig
from k3verify.plan.memory import PlanRequest, plan

GIB = 2**30
KNOWN_CARDS = "an H100 80 GB reports 79.1 GiB, an H200 140 GiB"


class DoesNotFit(RuntimeError):
    """The planned peak of a GPU workflow is more than the card holds."""


CARD_ENV = "K3V_CARD_GIB"  # run as if the card held this many GiB (a smaller card's limits on a larger one)


def env_gib(name: str, *, zero_ok: bool) -> float | None:
    """The environment variable `name` as a number of GiB (> 0, or >= 0 with zero_ok), or None where it is not set;
    a ValueError naming the variable and the value otherwise."""
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        gib = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of GiB; got {text!r}") from None
    if gib < 0 or (gib == 0 and not zero_ok):
        raise ValueError(f"{name} must be {'>=' if zero_ok else '>'} 0; got {text!r}")
    return gib


def card_cap_gib() -> float | None:
    """$K3V_CARD_GIB as a number of GiB, or None where it is not set."""
    return env_gib(CARD_ENV, zero_ok=False)


def _cuda(device: torch.device | str | None) -> torch.device:
    if not torch.cuda.is_available():
        raise ValueError(f"no CUDA device here to read the card's memory from: pass it in GiB ({KNOWN_CARDS})")
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device {dev} is not a CUDA device: its memory is not a card's")
    return dev


def device_memory_gib(device: torch.device | str | None = None) -> float:
    """The memory of the CUDA device (the current one by default), in GiB; a ValueError naming what to pass where
    there is no CUDA device to read. With $K3V_CARD_GIB set below the card's memory, that many GiB, and torch's
    allocator is held to it (torch.cuda.set_per_process_memory_fraction): an H200 runs as an 80 GB card would."""
    dev = _cuda(device)
    total = torch.cuda.get_device_properties(dev).total_memory / GIB
    cap = card_cap_gib()
    if cap is None or cap >= total:
        return total
    torch.cuda.set_per_process_memory_fraction(cap / total, torch.cuda.current_device() if dev.index is None else dev)
    return cap


def free_bytes(device: torch.device | str | None = None) -> int:
    """Bytes a new allocation may still take on the CUDA device: what the card has free plus what torch's allocator
    holds unused, within $K3V_CARD_GIB where it is set."""
    dev = _cuda(device)
    idle, _ = torch.cuda.mem_get_info(dev)
    reserved, allocated = torch.cuda.memory_reserved(dev), torch.cuda.memory_allocated(dev)
    limit = int(device_memory_gib(dev) * GIB)
    return max(0, min(idle, limit - reserved)) + reserved - allocated


def require_fit(what: str, need_bytes: int, card_gib: float, hint: str) -> None:
    """DoesNotFit "<what> needs X GiB, this card has Y GiB; try <hint>" when need_bytes > card_gib."""
    need = need_bytes / GIB
    if need > card_gib:
        raise DoesNotFit(f"{what} needs {need:.1f} GiB, this card has {card_gib:.1f} GiB; try {hint}")


def require_plan_fits(cfg: ModelConfig, what: str, *, context: int, batch: int, segment: int, dtype: torch.dtype,
                      device: torch.device | str, hint: str) -> None:
    """On a CUDA device: the planned peak of one rank serving `cfg` (weights, caches, the transients of one prefill
    step of `segment` tokens; plan/memory.py) must fit the card, else DoesNotFit with the sizes. Elsewhere a no-op."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    need = plan(cfg, PlanRequest(1, 1, context, batch, min(segment, context), dtype))[0].total
    require_fit(what, need, device_memory_gib(dev), hint)
