"""MLA prefill attention over a whole pack in one call (kernels/attn/packed.py), CUDA only.

The fused path pads the pack once and makes one SDPA call; it is held to the one-sequence-at-a-time eager
reference in fp64 on four packs: fresh sequences of one length and of ragged lengths (the is_causal path, no
mask), equal-length continuations over cached prefixes, and a ragged pack of a fresh sequence, a continuation
and a single-token continuation (the mask path).
"""

from __future__ import annotations

import torch

from k3verify.gates import CheckContext, Kind, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.kernels import attn as attn_ops
from k3verify.kernels.attn import packed as attn_packed
from k3verify.kernels.registry import CUDA

H, D, DV = 5, 18, 10
PACKS = {  # name -> per sequence (queries, cached prefix)
    "equal_fresh": [(48, 0)] * 4,
    "ragged_fresh": [(40, 0), (7, 0), (23, 0)],
    "equal_prefixed": [(16, 8)] * 3,
    "ragged": [(80, 0), (33, 17), (1, 40)],
}


Pack = tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[tuple[int, int, int]]]


def _pack(g: torch.Generator, seqs: list[tuple[int, int]]) -> Pack:
    """q/k/v [T, h, d] packed (keys: each sequence's prefix then its own tokens), q_cu, key ranges."""
    q_cu, ranges, k_at = [0], [], 0
    for lq, prefix in seqs:
        q_cu.append(q_cu[-1] + lq)
        ranges.append((k_at, k_at + prefix + lq, prefix))
        k_at += prefix + lq
    q = torch.randn(q_cu[-1], H, D, generator=g)
    k, v = torch.randn(k_at, H, D, generator=g), torch.randn(k_at, H, DV, generator=g)
    return q, k, v, q_cu, ranges


@register_check(
    id="kernel.attn.packed_vs_torch", component="kernel", level="kernel", kind=Kind.RMS, devices=("cuda",),
    bar=1e-2, bar_reason="bf16 inputs and output against fp64, as kernel.attn.sdpa_vs_torch (eager bf16 sits "
    "4-5e-3 from fp64, SDPA 3e-3; a mask one key late above 0.19)",
    control="every sequence's causal mask one key late (each query also sees the next key)",
)
@builders.single_thread
def check_attn_packed(ctx: CheckContext) -> Trial:
    ref, cand, ctrl = {}, {}, {}
    for name, seqs in PACKS.items():
        q, k, v, q_cu, ranges = _pack(ctx.generator, seqs)
        scale = D**-0.5
        qb, kb, vb = (t.bfloat16().to(ctx.device) for t in (q, k, v))
        cand[name] = attn_ops.causal_attention_packed(qb, kb, vb, q_cu, ranges, scale).float().cpu()
        builders.assert_routed(attn_ops.CAUSAL_PACKED, backend=CUDA)
        ref[name] = attn_packed.causal_attention_packed_torch(q.double(), k.double(), v.double(), q_cu, ranges,
                                                             scale).float()
        # one key late: each query also sees the next key (the next sequence's first; the pack's last sequence
        # has none and stays as it is)
        late = [(k0, k1 + 1, off + 1) if k1 < k.shape[0] else (k0, k1, off) for k0, k1, off in ranges]
        ctrl[name] = attn_packed.causal_attention_packed_sdpa(qb, kb, vb, q_cu, late, scale).float().cpu()
    return Trial(reference=ref, candidate=cand, control=ctrl, position_dim=0,
                 notes=[f"h {H}, dk {D}, dv {DV}; " + "; ".join(f"{n}: {s}" for n, s in PACKS.items())])
