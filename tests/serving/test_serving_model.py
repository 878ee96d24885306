"""ServingModel behaviours that are not parity: strict loading, refusals, engagement of the fast paths."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from k3verify.checkpoint.loader import WeightLoadError
from k3verify.presets import get_preset
from k3verify.serving.batch import PackedBatch
from k3verify.serving.layers.kda import check_pieces, segment_pieces
from k3verify.serving.layers.mlp import TILE_ALIGN, GatedMLP, even_tiles
from k3verify.serving.layers.moe import SparseMoE
from k3verify.serving.model import ServingModel


def test_loading_is_strict_and_mxfp4_stays_packed(build_model: Callable[..., ServingModel],
                                                   preset_weights: Callable[[str], dict]) -> None:
    cfg = get_preset("k3-tiny")
    tensors = dict(preset_weights("k3-tiny"))
    name = next(k for k in tensors if k.endswith("experts.0.w1.weight_packed"))
    model = build_model("k3-tiny")
    held = dict(model.named_buffers())[name.removeprefix(cfg.checkpoint_prefix)]
    assert held.dtype == torch.uint8 and torch.equal(held, tensors[name])
    del tensors[name]
    with pytest.raises(WeightLoadError, match="without a source"):
        ServingModel(cfg, torch.float32).load(tensors)


def test_unknown_modes_raise() -> None:
    cfg = get_preset("k3-tiny")
    with pytest.raises(ValueError, match="mxfp4_mode"):
        ServingModel(cfg, torch.float32, "cpu", "lazy")
    with pytest.raises(ValueError, match="tile_tokens"):
        GatedMLP(cfg, 8, 8, torch.float32, tile_tokens=3)


def test_mxfp4_modes_compute_the_same(build_model: Callable[..., ServingModel]) -> None:
    ids = torch.arange(40) * 97 % 4000
    batch = PackedBatch.build(ids, [40])
    cached = build_model("k3-tiny", mxfp4_mode="cached").prefill(batch).logits
    per_use = build_model("k3-tiny", mxfp4_mode="per_use").prefill(batch).logits
    assert torch.equal(cached, per_use)


def test_segment_cuts_off_the_chunk_grid_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of the 64-token"):
        segment_pieces([100], 96)
    check_pieces([200, 64], segment_pieces([200, 64], 128))
    with pytest.raises(ValueError, match="mid-chunk"):
        check_pieces([200], [[(0, 96), (96, 200)]])
    with pytest.raises(ValueError, match="do not tile"):
        check_pieces([200], [[(0, 64), (70, 200)]])


def test_even_tiles_cover_rows_once_and_stay_aligned() -> None:
    for total in (1, 15, 16, 17, 100, 200, 1000):
        for rows in (16, 48, 300):
            tiles = even_tiles(total, rows)
            assert tiles[0][0] == 0 and tiles[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(tiles[:-1], tiles[1:], strict=True))
            assert all(a % TILE_ALIGN == 0 for a, _ in tiles)
            assert len(tiles) == 1 or all(b - a >= TILE_ALIGN for a, b in tiles)


def test_tiled_mlp_is_bit_identical(build_model: Callable[..., ServingModel]) -> None:
    mlp = build_model("k3-skew-10").model.layers[0].mlp  # intermediate 136: rows are not SIMD-multiples
    x = torch.randn(203, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(0))
    whole = mlp(x)
    mlp.tile_tokens = 40
    assert torch.equal(mlp(x), whole)


def test_engagement_counters_and_no_decode_without_caches(build_model: Callable[..., ServingModel]) -> None:
    model = build_model("k3-tiny")
    out = model.prefill(PackedBatch.build(torch.arange(150) % 4000, [150]), segment_len=64)
    assert out.stats["kda_segmented"] == len(model.cfg.kda_layers) and out.stats["attn_res_prealloc"] == 1
    with pytest.raises(RuntimeError, match="allocate_caches"):
        model.decode(torch.tensor([1]), [1], [[1]], [3])
    assert any(isinstance(m, SparseMoE) for m in model.modules())
