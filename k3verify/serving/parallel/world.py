"""A serving world on this host: rank 0 in this process (it runs the engine), ranks 1.. spawned as followers.

Every rank builds its own slice of the model from the checkpoint (only its bytes are read) and the same
caches; rank 0 gets a MirroredRunner, the followers replay it (serving/parallel/runner.py).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from k3verify.checkpoint.hf_interop import normalize_hf_names
from k3verify.checkpoint.reader import CheckpointReader
from k3verify.checkpoint.snapshot import CheckpointSnapshot
from k3verify.config import ModelConfig
from k3verify.serving.parallel.comm import Comm, init_world, leave_world
from k3verify.serving.parallel.launch import rendezvous_file
from k3verify.serving.parallel.layout import ParallelLayout, check_layout
from k3verify.serving.parallel.model import ParallelServingModel
from k3verify.serving.parallel.runner import ControlChannel, MirroredRunner, follow
from k3verify.serving.runner import ModelRunner


@dataclass(frozen=True)
class WorldSpec:
    checkpoint_dir: str
    tp: int
    ep: int
    device_type: str  # "cpu" (gloo) or "cuda" (NCCL, rank r on cuda:r)
    caches: dict[str, int]  # ModelRunner's num_pages, page_size, num_slots, max_context
    dtype: torch.dtype = torch.bfloat16
    names: str = "published"  # "transformers": tensor spellings read through hf_interop's name map
    digest: str | None = None  # the gated checkpoint digest: each rank loads from a snapshot that must have it

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    def device(self, rank: int) -> torch.device:
        return torch.device(f"cuda:{rank}") if self.device_type == "cuda" else torch.device("cpu")


def _join(spec: WorldSpec, rank: int, init_file: str) -> tuple[Comm, ControlChannel, ParallelServingModel]:
    device = spec.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    comm = init_world(ParallelLayout(spec.tp, spec.ep, rank), device, init_file)
    channel = ControlChannel(spec.world)
    if spec.digest is None:
        cfg = ModelConfig.from_file(Path(spec.checkpoint_dir) / "config.json")
        with CheckpointReader(spec.checkpoint_dir) as reader:
            tensors = normalize_hf_names(cfg, reader) if spec.names == "transformers" else reader
            model = ParallelServingModel(cfg, comm, spec.dtype, device).load(tensors)
        return comm, channel, model
    # served: this rank's weights and config come from bytes it hashed itself, checked against the gated digest
    snap = CheckpointSnapshot.read(spec.checkpoint_dir)
    if snap.digest != spec.digest:
        raise ValueError(f"rank {rank}: {spec.checkpoint_dir} changed since it was gated (its digest is now "
                         f"{snap.digest}, the gate vouched for {spec.digest})")
    cfg = ModelConfig.from_bytes(snap.data("config.json"), snap.files.get("generation_config.json"))
    snapped = snap.tensors()
    model = ParallelServingModel(cfg, comm, spec.dtype, device).load(
        normalize_hf_names(cfg, snapped) if spec.names == "transformers" else snapped)
    snap.drop_shards()
    return comm, channel, model


def follower_main(index: int, init_file: str, spec: WorldSpec) -> None:
    """Rank index + 1: build its slice, then replay rank 0's runner calls until told to stop."""
    comm, channel, model = _join(spec, index + 1, init_file)
    try:
        follow(ModelRunner(model, **spec.caches), channel)
    finally:
        leave_world(comm)


class ServingWorld:
    """Start the followers, join them as rank 0, and hand out rank 0's runner; `close()` stops them all."""

    def __init__(self, cfg: ModelConfig, spec: WorldSpec) -> None:
        check_layout(cfg, ParallelLayout(spec.tp, spec.ep))
        if spec.device_type == "cuda" and torch.cuda.device_count() < spec.world:
            raise ValueError(f"tp={spec.tp} ep={spec.ep} needs {spec.world} GPUs (one per rank); "
                             f"{torch.cuda.device_count()} visible")
        self.spec = spec
        init_file = rendezvous_file(tempfile.mkdtemp(prefix="k3v-serve-"))
        self.followers: Any = mp.start_processes(follower_main, args=(init_file, spec), nprocs=spec.world - 1,
                                                 join=False, start_method="spawn")
        self.comm, channel, model = _join(spec, 0, init_file)
        self.runner = MirroredRunner(model, channel, **spec.caches)

    def close(self) -> None:
        try:
            self.runner.shutdown()
            self.followers.join()
        finally:
            leave_world(self.comm)
