"""The fp32 logprob bar's factor comes from references, not from any endpoint: an independent fp32 implementation
(transformers' KimiLinear on fla's torch paths) is re-measured against the fp64 gold beside the oracle's own fp32."""

from __future__ import annotations

import torch

from k3verify.checkpoint.loader import load_into
from k3verify.gates.checks.endpoint.tokens import FP32_REFERENCE_SPREAD
from k3verify.oracle.hf_kimi_linear import build_hf_model, hf_forward
from k3verify.oracle.k3_reference import K3Reference
from k3verify.target import resolve_target


def _centred_top5(gold: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    idx = gold.topk(5, dim=-1).indices
    g, o = gold.gather(1, idx), other.gather(1, idx)
    return g - g.mean(1, keepdim=True), o - o.mean(1, keepdim=True)


def test_an_independent_fp32_reference_sits_within_the_recorded_spread() -> None:
    """transformers' fp32 distance from the fp64 gold over ours, on kl-tiny's rows (the endpoint checks' measure):
    at most FP32_REFERENCE_SPREAD, and above 1 (else the spread would not be a spread)."""
    target = resolve_target("kl-tiny")
    tensors = target.weights()
    models = {}
    for dtype in (torch.float64, torch.float32):
        models[dtype] = K3Reference(target.cfg, dtype)
        load_into(models[dtype], target.cfg, tensors)
    hf = build_hf_model(target.cfg, target.hf_config(), tensors, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    ours = theirs = 0.0
    for n in (21, 33, 56):
        ids = torch.randint(0, 300, (n,), generator=g)
        with torch.no_grad():
            gold = torch.log_softmax(models[torch.float64](ids).logits.double(), -1)
            own = torch.log_softmax(models[torch.float32](ids).logits.double(), -1)
            other = torch.log_softmax(hf_forward(hf, ids)[0].double(), -1)
        gc, oc = _centred_top5(gold, own)
        _, hc = _centred_top5(gold, other)
        ours += float((oc - gc).pow(2).sum())
        theirs += float((hc - gc).pow(2).sum())
    spread = (theirs / ours) ** 0.5
    assert 1.0 < spread <= FP32_REFERENCE_SPREAD, spread
