"""What a check's run took of the machine, not what it measured of the target: the card's and the host's peak
memory during the check (the run's cached models and data included), recorded in its metrics and never compared."""

from __future__ import annotations

import torch

from k3verify.plan.host_memory import host_peak_bytes, reset_host_peak

RESOURCE_METRICS = {"cuda_peak_gib": "CUDA", "host_peak_gib": "host"}  # metric -> what a console line calls it


class PeakMemory:
    """Started before a check: resets the peaks it can; `record` puts them into the check's metrics."""

    def __init__(self, device_kind: str) -> None:
        self.cuda = device_kind == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.host = reset_host_peak()  # False where the host's peak cannot be reset (no /proc): not recorded

    def record(self, metrics: dict[str, float]) -> None:
        if self.cuda:
            metrics["cuda_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        host = host_peak_bytes() if self.host else None
        if host is not None:
            metrics["host_peak_gib"] = host / 2**30
