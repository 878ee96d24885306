"""The streamed gold: K3Reference run one decoder layer at a time, so the oracle never holds the whole model.

The reference is built on the meta device; each piece (the embeddings, one decoder layer, the final norm and
lm_head) is materialised on the device, loaded from the checkpoint in the reference's dtype, run over the carried
state (the residual stream, and K3's finished block sums) and dropped again. Peak memory is one layer's weights
plus activations plus the carried state, not the model. The arithmetic is K3Reference's own (Model.start / step /
finish), op for op, so the logits are bit-identical to the whole-model reference's where both fit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from k3verify.checkpoint.loader import load_into, plan_sources
from k3verify.config import ModelConfig
from k3verify.oracle import functional as Fn
from k3verify.oracle.k3_reference import K3Reference, ReferenceOutput


@dataclass
class StreamStats:
    """Largest piece materialised at once (bytes of weights) and, on CUDA, the peak allocated during the run."""

    peak_piece_bytes: int = 0
    peak_piece: str = ""
    cuda_peak_bytes: int | None = None

    def describe(self) -> str:
        cuda = "" if self.cuda_peak_bytes is None else f"; CUDA peak {self.cuda_peak_bytes / 2**30:.2f} GiB"
        return f"streamed gold: largest piece {self.peak_piece} {self.peak_piece_bytes / 2**30:.3f} GiB{cuda}"


LayerOrder = Callable[[int], list[int]]


def _in_order(n: int) -> list[int]:
    return list(range(n))


class StreamedReference:
    """K3Reference(cfg, dtype) over `tensors` (checkpoint names, read lazily), run piece by piece on `device`."""

    def __init__(self, cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", layer_order: LayerOrder = _in_order) -> None:
        with torch.device("meta"):
            self.ref = K3Reference(cfg, dtype)
        plan_sources(cfg, list(tensors.keys()), list(self.ref.state_dict().keys()))  # the whole name map, strictly
        self.cfg, self.tensors, self.dtype, self.device = cfg, tensors, dtype, torch.device(device)
        self.layer_order = layer_order
        self.stats = StreamStats()

    def _load(self, prefix: str, *modules: nn.Module) -> None:
        for m in modules:
            m.to_empty(device=self.device)
        load_into(self.ref, self.cfg, self.tensors, prefix)
        size = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
        if size > self.stats.peak_piece_bytes:
            self.stats.peak_piece_bytes, self.stats.peak_piece = size, prefix.rstrip(".") or "model"

    @staticmethod
    def _drop(*modules: nn.Module) -> None:
        for m in modules:
            m.to(device="meta")

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, capture: bool = False) -> ReferenceOutput:
        """ids [T] -> logits [T, V] in the reference dtype (captures per sublayer when asked), as K3Reference."""
        if input_ids.dim() != 1:
            raise ValueError(f"the streamed reference takes one sequence of ids [T]; got {tuple(input_ids.shape)}")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        model = self.ref.model
        captures: dict[str, torch.Tensor] | None = {} if capture else None
        self._load("model.embed_tokens.", model.embed_tokens)
        carry = model.start(model.embed_tokens.weight[input_ids.to(self.device)])
        self._drop(model.embed_tokens)
        layers = model.decoder_layers()
        for i in self.layer_order(len(layers)):
            self._load(f"model.layers.{i}.", layers[i])
            carry = model.step(i, layers[i], carry, captures)
            self._drop(layers[i])
        tail = [m for name, m in model.named_children() if name not in ("embed_tokens", "layers")]
        self._load("model.norm.", *tail)
        if self.cfg.uses_attn_res:
            load_into(self.ref, self.cfg, self.tensors, "model.output_attn_res_")
        hidden = model.finish(carry, captures)
        self._drop(*tail)
        self._load("lm_head.", self.ref.lm_head)
        logits = Fn.linear(hidden, self.ref.lm_head.weight)
        self._drop(self.ref.lm_head)
        if self.device.type == "cuda":
            self.stats.cuda_peak_bytes = torch.cuda.max_memory_allocated(self.device)
        return ReferenceOutput(logits=logits, captures=captures or {})
