"""What a GGUF's quantization costs, measured apart from whether a server computes it right.

- Weights: each tensor of the GGUF (dequantized) against the checkpoint's: relative RMS error and largest
  absolute error, by tensor and summed up by tensor kind and by layer.
- Model: next-token distributions of the oracle on the checkpoint (exact, fp64) against the oracle on the GGUF in
  llama.cpp's arithmetic for it (w-gguf-a8, fp64 gold): mean and p99 KL divergence KL(checkpoint || GGUF) over the
  whole vocabulary, and top-1 agreement. That is the quantization's own cost.
- Server: where an endpoint answered (parity --endpoint), its top-k logprobs against both oracles: the KL summed
  over the server's top-k tokens only (said so: an endpoint sends no more), so "the server adds X on top of the
  quantization's Y" reads off one line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

PRIVATE_TOPK_NOTE = ("over the server's top-k tokens only, both distributions renormalised over them (the endpoint "
                     "sends top-k logprobs, not the distribution)")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True)
class TensorError:
    name: str
    kind: str  # the name with its layer and expert indices taken out
    layer: int | None
    ggml_type: str
    rel_rms: float
    max_abs: float


def tensor_kind(name: str) -> tuple[str, int | None]:
    m = _LAYER.search(name)
    layer = int(m.group(1)) if m else None
    kind = _EXPERT.sub(".experts.*.", _LAYER.sub(".layers.*.", name)).lstrip(".")
    return kind, layer


def weight_errors(reference: Mapping[str, torch.Tensor], quantized: Mapping[str, torch.Tensor],
                  types: Mapping[str, Any]) -> list[TensorError]:
    """Every tensor of `quantized` against the same name in `reference` (both under one naming)."""
    out = []
    for name in quantized:
        ref, q = reference[name].double(), quantized[name].double()
        if ref.shape != q.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(ref.shape)}, GGUF shape {tuple(q.shape)}")
        diff = q - ref
        scale = float(ref.pow(2).mean().sqrt())
        rel = float(diff.pow(2).mean().sqrt()) / scale if scale > 0 else float(diff.abs().max())
        kind_type = types.get(name, "?")
        ggml_type = kind_type if isinstance(kind_type, str) else "/".join(f"{k}:{v}" for k, v in kind_type.items())
        kind, layer = tensor_kind(name)
        out.append(TensorError(name, kind, layer, ggml_type, rel, float(diff.abs().max())))
    return out


def summarize_errors(errors: Sequence[TensorError]) -> dict[str, Any]:
    """By kind (types seen, worst and RMS-mean relative error) and by layer (RMS-mean relative error)."""
    by_kind: dict[str, list[TensorError]] = {}
    by_layer: dict[int, list[TensorError]] = {}
    for e in errors:
        by_kind.setdefault(e.kind, []).append(e)
        if e.layer is not None:
            by_layer.setdefault(e.layer, []).append(e)

    def mean(rows: Iterable[TensorError]) -> float:
        values = [r.rel_rms for r in rows]
        return math.sqrt(sum(v * v for v in values) / len(values))

    return {"by_kind": {k: {"types": sorted({r.ggml_type for r in rows}), "tensors": len(rows),
                            "rel_rms": mean(rows), "rel_rms_max": max(r.rel_rms for r in rows),
                            "max_abs": max(r.max_abs for r in rows)} for k, rows in sorted(by_kind.items())},
            "by_layer": {str(k): {"rel_rms": mean(rows), "tensors": len(rows)} for k, rows in sorted(by_layer.items())},
            "tensors": [asdict(e) for e in errors]}


def kl_rows(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row of log-softmax rows [P, V] (fp64)."""
    p_log, q_log = p_log.double(), q_log.double()
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def topk_kl(p_log: torch.Tensor, tops: Sequence[Mapping[int, float]]) -> torch.Tensor:
    """KL(p || server) over each row's listed top-k tokens, both renormalised over them (so never negative)."""
    values = []
    for row, top in zip(p_log.double(), tops, strict=True):
        if not top:
            values.append(float("nan"))
            continue
        ids = torch.tensor(list(top), dtype=torch.long)
        p = torch.log_softmax(row[ids], dim=0)
        q = torch.log_softmax(torch.tensor(list(top.values()), dtype=torch.float64), dim=0)
        values.append(float((p.exp() * (p - q)).sum()))
    return torch.tensor(values, dtype=torch.float64)


def stats(kl: torch.Tensor, agree: torch.Tensor) -> dict[str, float | int]:
    kl = kl[~torch.isnan(kl)]
    if kl.numel() == 0:
        return {"positions": 0}
    return {"positions": int(kl.numel()), "kl_mean": float(kl.mean()),
            "kl_p99": float(torch.quantile(kl, 0.99)), "kl_max": float(kl.max()),
            "top1_agreement": float(agree.double().mean())}


def model_cost(reference: Sequence[torch.Tensor], quantized: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Per-sequence log-softmax rows of the checkpoint oracle and the GGUF oracle: KL and top-1 agreement over all
    rows, and KL by position (mean over sequences) for the plot."""
    kl = [kl_rows(r, q) for r, q in zip(reference, quantized, strict=True)]
    agree = [r.argmax(-1) == q.argmax(-1) for r, q in zip(reference, quantized, strict=True)]
    return {**stats(torch.cat(kl), torch.cat(agree)), "kl_by_position": by_position(kl)}


def server_cost(reference: Sequence[torch.Tensor], quantized: Sequence[torch.Tensor],
                tops: Sequence[Sequence[Mapping[int, float]]], tokens: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The server's top-k logprobs (and its greedy tokens) against both oracles' rows at the same positions."""
    result: dict[str, Any] = {"over": PRIVATE_TOPK_NOTE}
    for label, rows in (("vs_checkpoint", reference), ("vs_gguf", quantized)):
        kl = [topk_kl(r, t) for r, t in zip(rows, tops, strict=True)]
        agree = [r.argmax(-1) == torch.tensor(list(tok), dtype=torch.long) for r, tok in zip(rows, tokens,
                                                                                             strict=True)]
        result[label] = {**stats(torch.cat(kl), torch.cat(agree)), "kl_by_position": by_position(kl)}
    return result


def by_position(kl: Sequence[torch.Tensor]) -> list[float]:
    longest = max((len(k) for k in kl), default=0)
    out = []
    for p in range(longest):
        values = [float(k[p]) for k in kl if p < len(k) and not math.isnan(float(k[p]))]
        out.append(sum(values) / len(values) if values else float("nan"))
    return out


def headline(quant: Mapping[str, Any], server: Mapping[str, Any] | None) -> str:
    """One line: the quantization's cost, and what the server adds on top of it."""
    line = (f"quantization: mean KL {quant['kl_mean']:.3g} (p99 {quant['kl_p99']:.3g}), top-1 agreement "
            f"{quant['top1_agreement']:.1%} against the checkpoint (whole vocabulary)")
    if server is None or server["vs_gguf"].get("positions", 0) == 0:
        return line
    return (f"{line}; the server adds mean KL {server['vs_gguf']['kl_mean']:.3g} on top of it (vs the GGUF's own "
            f"oracle; {server['vs_checkpoint']['kl_mean']:.3g} vs the checkpoint), top-1 agreement "
            f"{server['vs_gguf']['top1_agreement']:.1%}, over its top-k tokens")
