"""Paged latent cache and KDA state pool bookkeeping, and that check_integrity catches each violation."""

from __future__ import annotations

import pytest
import torch

from k3verify.presets import get_preset
from k3verify.serving.batch import SCRATCH
from k3verify.serving.kv_cache import CacheError, PagedLatentCache
from k3verify.serving.state_cache import KDAStatePool

CFG = get_preset("k3-tiny")


def test_latent_cache_layout_and_reserve_free_roundtrip() -> None:
    cache = PagedLatentCache(CFG, num_pages=9, page_size=4, dtype=torch.bfloat16, device="cpu")
    assert cache.data.shape == (len(CFG.full_attn_layers), 9, 4, CFG.kv_lora_rank + CFG.qk_rope_head_dim)
    cache.reserve(1, 10)
    cache.reserve(2, 4)
    assert len(cache.table(1)) == 3 and len(cache.table(2)) == 1 and SCRATCH not in cache.table(1)
    cache.reserve(1, 12)  # still 3 pages
    assert len(cache.table(1)) == 3 and cache.num_free_pages == 4
    cache.check_integrity()
    cache.free(1)
    assert cache.num_free_pages == 7 and cache.owners == {2}
    cache.check_integrity()


def test_latent_cache_refuses_overcommit_without_side_effects() -> None:
    cache = PagedLatentCache(CFG, num_pages=4, page_size=4, dtype=torch.float32, device="cpu")
    with pytest.raises(CacheError, match="needs 4 more page"):
        cache.reserve(7, 16)
    assert cache.num_free_pages == 3 and 7 not in cache.owners
    with pytest.raises(CacheError, match="holds no pages"):
        cache.free(7)
    with pytest.raises(ValueError, match="scratch page"):
        PagedLatentCache(CFG, num_pages=1, page_size=4, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("fault", ["double_owned", "free_and_owned", "lost", "scratch_out", "dup_free"])
def test_latent_cache_integrity_catches(fault: str) -> None:
    cache = PagedLatentCache(CFG, num_pages=8, page_size=4, dtype=torch.float32, device="cpu")
    cache.reserve(1, 8)
    cache.reserve(2, 8)
    cache.check_integrity()
    if fault == "double_owned":
        cache._tables[2].append(cache._tables[1][0])
    elif fault == "free_and_owned":
        cache._free.append(cache._tables[1][0])
    elif fault == "lost":
        cache._free.pop()
    elif fault == "scratch_out":
        cache._tables[2].append(SCRATCH)
    else:
        cache._free.append(cache._free[0])
    with pytest.raises(CacheError, match="integrity"):
        cache.check_integrity()


def test_state_pool_shapes_scratch_and_zeroing() -> None:
    pool = KDAStatePool(CFG, num_slots=3, device="cpu")
    L, h, dk = len(CFG.kda_layers), CFG.kda_num_heads, CFG.kda_head_dim
    assert pool.state.shape == (L, 4, h, dk, dk) and pool.state.dtype == torch.float32
    assert pool.conv_q.shape == (L, 4, CFG.kda_dim, CFG.conv_kernel_size - 1)
    pool.state.fill_(7.0)
    slots = [pool.allocate() for _ in range(3)]
    assert SCRATCH not in slots and sorted(slots) == [1, 2, 3]
    assert pool.state[:, slots].abs().sum() == 0 and (pool.state[:, SCRATCH] == 7.0).all()
    with pytest.raises(CacheError, match="no free KDA state slot"):
        pool.allocate()
    pool.free(slots[0])
    with pytest.raises(CacheError, match="not in use"):
        pool.free(slots[0])
    pool.check_integrity()


@pytest.mark.parametrize("fault", ["nan_state", "inf_conv", "scratch_used", "both", "lost"])
def test_state_pool_integrity_catches(fault: str) -> None:
    pool = KDAStatePool(CFG, num_slots=4, device="cpu")
    a, b = pool.allocate(), pool.allocate()
    pool.state[:, 4] = float("nan")  # an idle slot may hold anything (sentinels): not a violation
    pool.check_integrity()
    if fault == "nan_state":
        pool.state[1, a, 0, 0, 0] = float("nan")
    elif fault == "inf_conv":
        pool.conv_v[0, b, 3, 0] = float("inf")
    elif fault == "scratch_used":
        pool._used.add(SCRATCH)
    elif fault == "both":
        pool._free.append(a)
    else:
        pool._free.popleft()
    with pytest.raises(CacheError, match="integrity"):
        pool.check_integrity()
