"""`--weights-from GGUF`: a target whose config and tokenizer are the checkpoint's and whose weights are a GGUF
file's (peers/gguf_weights.py), each weight tagged with the ggml type it is stored in, so the `w-gguf-a8`
precision (oracle/gguf_arith.py) rounds every activation as llama.cpp's CPU path does for that type.

The target's digest binds both: sha256 over the checkpoint's digest and the GGUF's bytes. A report of such a run
is never one for the checkpoint itself (`serve` matches on the digest).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from k3verify.checkpoint.hf_interop import hf_name_plan, normalize_hf_names
from k3verify.checkpoint.reader import CheckpointReader
from k3verify.oracle import gguf_arith
from k3verify.peers.gguf_weights import GgufError, GgufTensors, read_gguf_weights
from k3verify.target import Target


@dataclass(frozen=True)
class GgufTarget(Target):
    """`Target` with the weights of `gguf`; `tensors` read once, at construction."""

    gguf: Path = Path()
    tensors: GgufTensors | None = field(default=None, compare=False, repr=False)
    base: Target | None = field(default=None, compare=False, repr=False)  # the checkpoint's own target

    def weights(self) -> Mapping[str, torch.Tensor]:
        assert self.tensors is not None  # gguf_target() always reads them
        return normalize_hf_names(self.cfg, self.tensors) if self.names == "transformers" else self.tensors

    def weight_types(self) -> dict[str, str | dict[str, str]]:
        """ggml type of each weight under the model's parameter names (our checkpoint names)."""
        assert self.tensors is not None
        types = self.tensors.types
        if self.names != "transformers":
            return dict(types)
        plan = hf_name_plan(self.cfg, self.tensors.keys())
        return {ours: types[source.name] for ours, source in plan.items() if source.index is None}

    def describe(self) -> dict[str, object]:
        """What the report records about the weights' source."""
        assert self.tensors is not None
        return {"gguf": str(self.gguf), "architecture": self.tensors.arch, "types": self.tensors.type_counts(),
                "tokenizer_pre": self.tensors.metadata.get("tokenizer_pre")}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_target(target: Target, gguf: str | Path) -> GgufTarget:
    """`target` with its weights read from `gguf`; a GgufError naming the value when the file is not a GGUF,
    holds a type gguf-py cannot dequantize or the oracle cannot multiply, or does not match the checkpoint."""
    path = Path(gguf)
    with CheckpointReader(target.checkpoint_dir) as reader:
        shapes = {name: tuple(entry.shape) for name, entry in reader.entries.items()}
    tensors = read_gguf_weights(path, shapes, json.loads((target.checkpoint_dir / "config.json").read_text()))
    for name, kind in tensors.types.items():
        for one in ([kind] if isinstance(kind, str) else kind.values()):
            if one not in gguf_arith.ACTIVATION_OF:
                raise GgufError(f"{path}: the tensor for {name}: {_why(one)}")
    digest = hashlib.sha256(f"{target.digest}\n{file_sha256(path)}".encode()).hexdigest()
    return GgufTarget(target.cfg, target.name, target.preset, target.checkpoint_dir, digest, target.names,
                      gguf=path, tensors=tensors, base=target)


def _why(kind: str) -> str:
    try:
        gguf_arith.activation_format(kind)
    except gguf_arith.UnsupportedWeightType as exc:
        return str(exc)
    return ""


def tag_model(model: nn.Module, target: Target) -> None:
    """Tag `model`'s weights with their GGUF types when `target` reads a GGUF (a no-op otherwise)."""
    if isinstance(target, GgufTarget):
        params = dict(model.named_parameters())
        gguf_arith.tag(model, {n: t for n, t in target.weight_types().items() if n in params})
