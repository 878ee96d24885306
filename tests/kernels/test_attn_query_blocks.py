"""Attention that never holds the whole [h, Lq, Lk] score matrix: the serving reference and the oracle run their
queries in blocks and stay bit-identical to one pass; the fused path over a cached prefix builds no dense mask."""

from __future__ import annotations

import types

import pytest
import torch

from k3verify.kernels.attn import packed, sdpa, torch_ref
from k3verify.oracle import functional as Fn

HEAD_DIMS = [(24, 16), (18, 10)]  # (qk, v) head dims of the synthetic presets (k3-skew-10 decouples them)


def _qkv(h: int, lq: int, lk: int, dims: tuple[int, int], dtype: torch.dtype, seed: int = 0
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(h, lq, dims[0], generator=g).to(dtype), torch.randn(h, lk, dims[0], generator=g).to(dtype),
            torch.randn(h, lk, dims[1], generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=str)
def test_query_blocked_reference_equals_one_pass(dtype: torch.dtype, dims: tuple[int, int],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """1,100 queries over a cached prefix of 37 run in two blocks (576 + 524) and give the one-pass bits (CPU GEMMs
    of a few hundred rows or more round each row alike); a block offset off by one does not."""
    q, k, v = _qkv(4, 1100, 1137, dims, dtype)
    assert torch_ref.query_block(4, 1100, 1137) == 576
    monkeypatch.setattr(torch_ref, "MAX_QUERY_BLOCK", 1 << 20)
    one_pass = torch_ref.causal_attention(q, k, v, 37, 0.3)
    monkeypatch.undo()
    assert torch.equal(torch_ref.causal_attention(q, k, v, 37, 0.3), one_pass)
    monkeypatch.setattr(torch_ref, "_block", lambda q, k, v, off, s, plain=torch_ref._block: plain(q, k, v, off + 1, s)
                        if off > 37 + 500 else plain(q, k, v, off, s))
    assert not torch.equal(torch_ref.causal_attention(q, k, v, 37, 0.3), one_pass)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_query_blocked_oracle_equals_one_pass(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv(4, 1100, 1100, HEAD_DIMS[0], dtype, seed=1)
    one_pass = Fn.causal_attention(q, k, v, 0.3)
    monkeypatch.setattr(Fn, "ATTENTION_MAX_SCORES", 4 * 1100 * 600)
    assert Fn.attention_query_block(4, 1100) == 576
    assert torch.equal(Fn.causal_attention(q, k, v, 0.3), one_pass)
    plain = Fn._attention_rows
    monkeypatch.setattr(Fn, "_attention_rows", lambda q, k, v, t0, s, a: plain(q, k, v, max(0, t0 - 1), s, a))
    assert not torch.equal(Fn.causal_attention(q, k, v, 0.3), one_pass)


@pytest.mark.parametrize("heads,tokens", [(96, 131072), (32, 131072), (4, 4000), (1, 7)])
def test_a_block_holds_a_bounded_score_matrix(heads: int, tokens: int) -> None:
    """At 128K tokens no block holds more than MAX_BLOCK_SCORES scores (plus one row tile of rounding)."""
    block = torch_ref.query_block(heads, tokens, tokens)
    assert heads * block * tokens <= torch_ref.MAX_BLOCK_SCORES + heads * torch_ref.ROW_TILE * tokens
    assert heads * Fn.attention_query_block(heads, tokens) * tokens <= Fn.ATTENTION_MAX_SCORES + heads * 64 * tokens


def test_fused_prefill_over_a_cached_prefix_builds_no_dense_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-sequence lower-right path (taken past MAX_MASK_ELEMENTS) equals the reference; no boolean mask of
    [Lq, Lk] is ever handed to SDPA on that path."""
    g = torch.Generator().manual_seed(3)
    lens, prefixes = [70, 33], [50, 0]
    q = torch.randn(sum(lens), 4, 24, generator=g)
    k = torch.randn(sum(n + p for n, p in zip(lens, prefixes, strict=True)), 4, 24, generator=g)
    v = torch.randn(k.shape[0], 4, 16, generator=g)
    q_cu, ranges, k0 = [0, 70, 103], [], 0
    for n, p in zip(lens, prefixes, strict=True):
        ranges.append((k0, k0 + n + p, p))
        k0 += n + p
    ref = packed.causal_attention_packed_torch(q.double(), k.double(), v.double(), q_cu, ranges, 0.3)
    masks: list[object] = []
    plain_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: object, **kw: object) -> torch.Tensor:
        masks.append(kw.get("attn_mask"))
        return plain_sdpa(*args, **kw)  # type: ignore[arg-type]
    spied = types.SimpleNamespace(scaled_dot_product_attention=spy)
    monkeypatch.setattr(sdpa, "F", spied)
    monkeypatch.setattr(packed, "F", spied)
    monkeypatch.setattr(packed, "MAX_MASK_ELEMENTS", 0)
    got = packed.causal_attention_packed_sdpa(q, k, v, q_cu, ranges, 0.3)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert masks and not any(isinstance(m, torch.Tensor) and m.dtype == torch.bool for m in masks), masks
    single = sdpa.causal_attention_sdpa(q[:70].transpose(0, 1), k[:120].transpose(0, 1), v[:120].transpose(0, 1),
                                        50, 0.3).transpose(0, 1)
    torch.testing.assert_close(single.double(), ref[:70], rtol=1e-5, atol=1e-5)
