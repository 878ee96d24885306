"""norm.add_rms: the residual add fused into the RMSNorm after it. The torch path is the add followed by the
RMSNorm bit for bit; the Triton kernel (Triton's CPU interpreter, in a child process) writes the same bits as the
add followed by the Triton RMSNorm, and broken variants do not; the decoder's deferred residual is the old
layer bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton_interp import broken_variant, child_report  # tests/kernels, on sys.path for pytest and the child

from k3verify.kernels import norm as norm_ops
from k3verify.kernels.norm import norm_launch, torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH

BF16, F32 = torch.bfloat16, torch.float32
EPS = 1e-6
CASES = [(W, R, wd) for W in (72, 2304, 9000) for R in (1, 5) for wd in (BF16, F32)]  # 9000: two BLOCK passes


def _case(W: int, R: int, wd: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = 10 ** (torch.rand(R, 1, generator=g) * 4.5 - 3.5)
    x = (torch.randn(R, W, generator=g) * scale).to(BF16)
    r = (torch.randn(R, W, generator=g) * scale).to(BF16)
    return x, r, torch.randn(W, generator=g).to(wd)


@pytest.mark.parametrize("wd", [BF16, F32])
@pytest.mark.parametrize("xd", [BF16, F32])
def test_torch_path_is_add_then_norm_bit_for_bit(xd: torch.dtype, wd: torch.dtype) -> None:
    x, r, w = (t.to(xd) if i < 2 else t.to(wd) for i, t in enumerate(_case(2304, 5, wd, 0)))
    s, y = norm_ops.add_rms_norm(x, r, w, EPS)
    assert REGISTRY.last_backend[norm_ops.ADD_RMS] == TORCH
    assert torch.equal(s, x + r) and torch.equal(y, torch_ref.rms_norm_torch(x + r, w, EPS))


BROKEN = {  # controls: the kernel module's own source with one fault, compared the same way
    "norm_of_x_alone": ("        s32 = s.to(tl.float32)\n        acc += s32 * s32",
                        "        s32 = x\n        acc += s32 * s32"),
    "sum_not_rounded": ("s32 = (x + r).to(s_ptr.dtype.element_ty).to(tl.float32)  # the stored s",
                        "s32 = (x + r)  # the stored s"),
}


def _compare(kernels: Any) -> dict[str, dict[str, float]]:
    """Per case: the share of bit-identical elements of s and y against the add followed by rms_norm_triton."""
    from k3verify.kernels.norm import norm_launch as impl

    out: dict[str, dict[str, float]] = {}
    for i, (W, R, wd) in enumerate(CASES):
        x, r, w = _case(W, R, wd, seed=i)
        ref_s = x + r
        ref_y = impl.rms_norm_triton(ref_s, w, EPS)
        real = impl._kernels
        try:
            impl._kernels = lambda: kernels  # type: ignore[assignment]
            s, y = impl.add_rms_norm_triton(x, r, w, EPS)
        finally:
            impl._kernels = real
        out[f"W{W}.R{R}.{wd}"] = {"s": (s.view(torch.int16) == ref_s.view(torch.int16)).float().mean().item(),
                                  "y": (y == ref_y).float().mean().item()}
    return out


def _interpreter_report(tmp: str) -> dict[str, Any]:
    from triton_interp import patch_interpreter

    from k3verify.kernels.norm import norm_kernel

    patch_interpreter()  # bf16 stores round to nearest even, as on the GPU
    report: dict[str, Any] = {"kernel": _compare(norm_kernel), "broken": {}}
    for name, (old, new) in BROKEN.items():
        report["broken"][name] = _compare(broken_variant(norm_kernel, name, old, new, tmp))
    return report


@pytest.fixture(scope="module")
def interpreter_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("triton", reason="triton is not installed: the interpreter test needs it")
    return child_report("test_kernels_norm_add", "_interpreter_report", str(tmp_path_factory.mktemp("norm_add")))


def test_fused_kernel_writes_the_add_then_norm_bits(interpreter_report: dict[str, Any]) -> None:
    assert len(interpreter_report["kernel"]) == len(CASES)
    for case, r in interpreter_report["kernel"].items():
        assert r == {"s": 1.0, "y": 1.0}, (case, r)


def test_broken_fused_kernels_are_caught(interpreter_report: dict[str, Any]) -> None:
    for name, cases in interpreter_report["broken"].items():
        assert any(r["y"] < 1.0 for r in cases.values()), (name, cases)


def test_refusals_name_the_reason() -> None:
    x, w = torch.randn(4, 8, dtype=BF16), torch.ones(8, dtype=BF16)
    assert "residual (4, 1)" in str(norm_launch.accepts_add(x, x[:, :1], w, EPS))
    assert "differs from x (4, 8) torch.bfloat16" in str(norm_launch.accepts_add(x, x.float(), w, EPS))
    assert "float32 activations" in str(norm_launch.accepts_add(x.float(), x.float(), w, EPS))


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_decoder_layer_deferred_residual_is_the_old_layer(dtype: torch.dtype) -> None:
    """DecoderLayer.forward (the residual adds inside the norms) equals the layer as written before, bit for bit:
    attn(norm(x)), x + a, ffn(norm(x + a)), x + a + f; and the model's deferred loop equals layer-by-layer."""
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors
    from k3verify.presets import get_preset
    from k3verify.serving.batch import PackedBatch
    from k3verify.serving.model import ServingModel

    cfg = get_preset("kl-tiny")  # the plain residual stream (K3's Block Attention Residuals defer nothing)
    model = ServingModel(cfg, dtype).load(synthetic_tensors(cfg, seed=0))
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    batch = PackedBatch.build(ids, [9])
    ctx = model._context(batch, None)
    x = model.model.embed_tokens(ids)
    with torch.no_grad():
        for layer in model.model.decoder_layers():
            a = layer.self_attn(layer.input_layernorm(x), ctx)
            old = x + a
            old = old + layer.ffn(layer.post_attention_layernorm(old))
            assert torch.equal(layer(x, model._context(batch, None), None), old), layer.layer_idx
            x = old
        whole = model.prefill(PackedBatch.build(ids, [9]), all_logits=True).all_logits
    assert whole is not None and torch.equal(whole, model.lm_head(model.model.norm(x)))
