"""mxfp4_mode "packed": the experts stay as the checkpoint stores them (codes + E8M0 scales, stacked once per
layer, no dense copy), compute what the dequantized experts compute, reload in place, and are what "auto"
serves on CUDA."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.kernels import mxfp4
from k3verify.kernels.registry import REGISTRY, TORCH
from k3verify.presets import get_preset
from k3verify.serving.batch import PackedBatch
from k3verify.serving.layers.moe import SparseMoE, resolve_mxfp4_mode
from k3verify.serving.model import ServingModel

BATCH = PackedBatch.build(torch.arange(40) * 97 % 4000, [17, 23])


def _moes(model: ServingModel) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one stack count once)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_cached_and_per_use(build_model: Callable[..., ServingModel], dtype: torch.dtype) -> None:
    """k3-tiny prefill logits: packed (the grouped op's torch reference on CPU) == dequantized experts, bit for
    bit on this preset (same GEMMs, each token's k terms summed in ascending expert order either way)."""
    cached = build_model("k3-tiny", dtype, mxfp4_mode="cached").prefill(BATCH, all_logits=True).all_logits
    REGISTRY.last_backend.pop(mxfp4.GROUPED_MM, None)
    packed = build_model("k3-tiny", dtype, mxfp4_mode="packed").prefill(BATCH, all_logits=True).all_logits
    assert REGISTRY.last_backend[mxfp4.GROUPED_MM] == TORCH
    assert cached is not None and packed is not None and torch.equal(cached, packed)


def test_packed_layers_hold_only_the_checkpoint_bytes(build_model: Callable[..., ServingModel]) -> None:
    """After a forward every expert buffer is a view of its layer's stack: the layer's expert storage is the
    stack's bytes (codes + scales), no dense or bf16 copy exists, and the names are still the checkpoint's."""
    model = build_model("k3-tiny", torch.bfloat16, mxfp4_mode="packed")
    names = {n for n, _ in model.named_buffers()}
    model.prefill(BATCH)
    assert {n for n, _ in model.named_buffers()} == names
    cfg = model.cfg
    per_layer = cfg.num_experts * 3 * cfg.expert_in_dim * cfg.moe_intermediate_size  # weights per layer
    for moe in _moes(model):
        stack = moe.packed_experts()
        buffers = [b for ex in moe.experts for b in ex.buffers()]
        assert all(b.dtype == torch.uint8 for b in buffers) and moe._dense is None and moe._stacked is None
        assert _storage_bytes(buffers) == stack.nbytes == per_layer // 2 + per_layer // cfg.quant.group_size
        assert not any(p.numel() for ex in moe.experts for p in ex.parameters())


def test_reloading_weights_updates_the_packed_stack(preset_weights: Callable[[str], dict]) -> None:
    """load() after the stack was built writes through the views and drops the stack: the next forward
    serves the new weights (== a fresh cached model on them)."""
    cfg = get_preset("k3-tiny")
    model = ServingModel(cfg, torch.float32, "cpu", "packed").load(preset_weights("k3-tiny"))
    first = model.prefill(BATCH).logits
    other = synthetic_tensors(cfg, seed=1)
    model.load(other)
    again = model.prefill(BATCH).logits
    fresh = ServingModel(cfg, torch.float32, "cpu", "cached").load(other).prefill(BATCH).logits
    assert torch.equal(again, fresh) and not torch.equal(again, first)


def test_auto_serves_packed_for_bf16_on_cuda_only() -> None:
    """"auto": packed for quantized bf16 experts on CUDA; cached on CPU / meta, for fp32, for dense experts;
    unknown modes raise naming the value."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_mxfp4_mode("auto", True, torch.bfloat16, cuda) == "packed"
    assert resolve_mxfp4_mode("auto", True, torch.bfloat16, cpu) == "cached"
    assert resolve_mxfp4_mode("auto", True, torch.float32, cuda) == "cached"
    assert resolve_mxfp4_mode("auto", False, torch.bfloat16, cuda) == "cached"
    assert resolve_mxfp4_mode("per_use", True, torch.bfloat16, cuda) == "per_use"
    with pytest.raises(ValueError, match="'lazy'"):
        resolve_mxfp4_mode("lazy", True, torch.bfloat16, cpu)
    assert ServingModel(get_preset("k3-tiny"), torch.bfloat16, "meta").mxfp4_mode == "cached"


def test_packed_experts_refuse_dense_layers() -> None:
    model = ServingModel(get_preset("kl-tiny"), torch.float32, "meta", "packed")
    moe = _moes(model)[0]
    assert not moe.is_packed
    with pytest.raises(ValueError, match="dense"):
        moe.packed_experts()
