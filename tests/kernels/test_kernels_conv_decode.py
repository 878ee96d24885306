"""The KDA short-conv decode step (conv.causal_decode): torch reference vs the packed gather conv, the Triton
kernel under the interpreter vs the torch reference, the layer's wiring and the cached weight cast."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton_interp import broken_variant, child_report  # tests/kernels, on sys.path for pytest and the child

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.kernels import conv as conv_ops
from k3verify.kernels.conv import torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON
from k3verify.presets import get_preset
from k3verify.serving.batch import PackedBatch
from k3verify.serving.model import ServingModel

SLOTS = [3, 0, 5, 1, 0, 8, 6]  # slot 0 = scratch, repeated like the padded rows of a graph bucket
KEEP = [1, 0, 1, 0, 0, 1, 1]  # slot 1: a fresh sequence over a stale window
NUM_SLOTS = 10
IDLE = [2, 4, 7, 9]
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _case(dtype: torch.dtype, D: int, W: int, seed: int = 0) -> tuple[QKV, QKV, QKV]:
    """xs 3 x [B, D], weights 3 x [D, W], pool windows 3 x [NUM_SLOTS, D, W-1] fp32; idle slots hold 1e30 / NaN."""
    g = torch.Generator().manual_seed(seed)
    B = len(SLOTS)
    xs = tuple(torch.randn(B, D, generator=g).to(dtype) for _ in range(3))
    weights = tuple((torch.randn(D, W, generator=g) * 0.5).to(dtype) for _ in range(3))
    windows = []
    for _ in range(3):
        win = torch.randn(NUM_SLOTS, D, W - 1, generator=g).to(dtype).float()
        win[IDLE[0::2]], win[IDLE[1::2]] = 1e30, float("nan")
        windows.append(win)
    return xs, weights, tuple(windows)  # type: ignore[return-value]


def _packed(xs: QKV, weights: QKV, windows: QKV, slots: torch.Tensor, keep: torch.Tensor
            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The packed gather conv on a decode pack (B sequences x 1 token), windows as initial state."""
    B = slots.numel()
    seg, zero, cu = torch.arange(B), torch.zeros(B, dtype=torch.long), torch.arange(B + 1)
    outs, finals = [], []
    for x, w, win in zip(xs, weights, windows, strict=True):
        init = win.index_select(0, slots).to(x.dtype) * keep.to(x.dtype)[:, None, None]
        y, final = torch_ref.causal_conv_varlen_torch(x, w, seg, zero, cu, init)
        outs.append(y)
        finals.append(final.float())
    return outs, finals


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place of a's dtype (bf16 or fp32), element-wise."""
    big = 1 << (8 * a.element_size() - 1)

    def ordinal(t: torch.Tensor) -> torch.Tensor:
        i = _bits(t).long()
        return torch.where(i < 0, -(i + big), i)
    return (ordinal(a) - ordinal(b)).abs()


@pytest.mark.parametrize("D", [16, 72, 4096])
@pytest.mark.parametrize("W", [3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_conv_equals_packed_conv_bitexact(dtype: torch.dtype, W: int, D: int) -> None:
    """Outputs and advanced windows of the torch decode step equal the packed conv's, bit for bit; idle slots
    keep their sentinels bit for bit."""
    xs, weights, windows = _case(dtype, D, W)
    slots, keep = torch.tensor(SLOTS), torch.tensor(KEEP).to(dtype)
    ref, finals = _packed(xs, weights, windows, slots, keep)
    pool = tuple(w.clone() for w in windows)
    out = torch_ref.causal_conv_decode_torch(xs, weights, pool, slots, keep)
    real = slots != 0
    for x, y, r, win, final, before in zip(xs, out, ref, pool, finals, windows, strict=True):
        assert y.dtype == dtype and torch.equal(y, r)
        assert torch.equal(win[slots[real]], final[real])
        assert torch.equal(win[slots[real]][..., -1], x[real].float())  # the newest tap is this step's input
        assert torch.equal(_bits(win[IDLE]), _bits(before[IDLE]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_steps_chain_like_one_packed_pass(dtype: torch.dtype) -> None:
    """A prefill of 2 tokens, then 5 decode steps on the pool's windows, equals one packed pass over all 7
    tokens of each sequence (D = 64: silu sees whole SIMD blocks in both)."""
    g = torch.Generator().manual_seed(1)
    B, D, W, T, first = 3, 64, 4, 7, 2
    xs = [torch.randn(B, T, D, generator=g).to(dtype) for _ in range(3)]
    weights = tuple((torch.randn(D, W, generator=g) * 0.5).to(dtype) for _ in range(3))
    whole = PackedBatch.build(torch.zeros(B * T, dtype=torch.long), [T] * B)
    ref = [torch_ref.causal_conv_varlen_torch(x.reshape(B * T, D), w, whole.seg_ids, whole.local_pos,
                                              whole.cu_seqlens, None)[0].view(B, T, D)
           for x, w in zip(xs, weights, strict=True)]
    slots = torch.tensor([2, 4, 1])
    pool = tuple(torch.zeros(5, D, W - 1) for _ in range(3))
    pre = PackedBatch.build(torch.zeros(B * first, dtype=torch.long), [first] * B)
    got: list[list[torch.Tensor]] = [[], [], []]
    for c, (x, w, win) in enumerate(zip(xs, weights, pool, strict=True)):
        y, final = torch_ref.causal_conv_varlen_torch(x[:, :first].reshape(-1, D), w, pre.seg_ids, pre.local_pos,
                                                      pre.cu_seqlens, None)
        win.index_copy_(0, slots, final.float())
        got[c].append(y.view(B, first, D))
    for t in range(first, T):
        step = conv_ops.conv_decode_qkv(tuple(x[:, t] for x in xs), weights, pool, slots, torch.ones(B, dtype=dtype))
        for c in range(3):
            got[c].append(step[c][:, None])
    assert REGISTRY.last_backend[conv_ops.CAUSAL_DECODE] == TORCH
    for c in range(3):
        assert torch.equal(torch.cat(got[c], dim=1), ref[c]), c
        tail = xs[c][:, T - (W - 1):].transpose(1, 2).float()
        assert torch.equal(pool[c][slots], tail)


# ---- the Triton kernel under the interpreter (a subprocess: TRITON_INTERPRET must precede the import) ----

INTERP_CASES = [(dt, W, D) for dt in ("bfloat16", "float32") for W in (3, 4) for D in (16, 72)] + [
    ("bfloat16", 4, 4096), ("float32", 3, 4096)]
BROKEN = {  # controls: the kernel's own source with one fault, compared the same way
    "window_not_shifted": ("tl.store(win + (j - 1) * s_tap, tap, mask=mask)",
                           "tl.store(win + j * s_tap, tap, mask=mask)"),
    "keep_ignored": ("keep = tl.load(keep_ptr + b).to(tl.float32)",
                     "keep = tl.load(keep_ptr + b).to(tl.float32) * 0.0 + 1.0"),
    "row_stride_ignored": ("x = tl.load(x_ptr + b * s_x + d", "x = tl.load(x_ptr + b * D + d"),
}


def _compare_kernel(launch: Any, dtype: torch.dtype, W: int, D: int, fused: bool = False) -> dict[str, float]:
    xs, weights, windows = _case(dtype, D, W, seed=W * 10_000 + D)
    if fused:  # q/k/v as column slices of one wider projection output, as the layer's fused GEMM makes them
        wide = torch.cat([*xs, torch.full((xs[0].shape[0], 5), 1e30).to(dtype)], dim=1)
        xs = (wide[:, :D], wide[:, D:2 * D], wide[:, 2 * D:3 * D])
    slots, keep = torch.tensor(SLOTS), torch.tensor(KEEP).to(dtype)
    ref_pool, tri_pool = tuple(w.clone() for w in windows), tuple(w.clone() for w in windows)
    ref = torch_ref.causal_conv_decode_torch(xs, weights, ref_pool, slots, keep)
    out = launch(xs, weights, tri_pool, slots, keep)
    real = slots != 0
    ulps = torch.stack([_ulps(a, b) for a, b in zip(out, ref, strict=True)])
    windows_equal = all(torch.equal(_bits(a[slots[real]]), _bits(b[slots[real]])) and
                        torch.equal(_bits(a[IDLE]), _bits(b[IDLE])) for a, b in zip(tri_pool, ref_pool, strict=True))
    return {"max_ulp": ulps.max().item(), "frac_diff": (ulps > 0).float().mean().item(),
            "windows_equal": float(windows_equal)}


def _interpreter_report(tmp: str) -> dict[str, Any]:
    """Runs in the subprocess (TRITON_INTERPRET=1): the kernel and its broken variants vs the torch reference."""
    from k3verify.kernels.conv import decode_kernel

    report: dict[str, Any] = {"cases": {}, "broken": {}}
    for dt, W, D in INTERP_CASES:
        report["cases"][f"{dt}-W{W}-D{D}"] = _compare_kernel(decode_kernel.conv_decode_qkv_triton,
                                                             getattr(torch, dt), W, D)
    report["cases"]["bfloat16-W4-D72-fused-slices"] = _compare_kernel(decode_kernel.conv_decode_qkv_triton,
                                                                      torch.bfloat16, 4, 72, fused=True)
    for name, (old, new) in BROKEN.items():
        module = broken_variant(decode_kernel, name, old, new, tmp)
        report["broken"][name] = _compare_kernel(module.conv_decode_qkv_triton, torch.bfloat16, 4, 72,
                                                 fused=name == "row_stride_ignored")
    return report


@pytest.fixture(scope="module")
def interpreter_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("triton", reason="triton is not installed: the interpreter test needs it")
    return child_report("test_kernels_conv_decode", "_interpreter_report",
                        str(tmp_path_factory.mktemp("conv_decode_interp")))


def test_triton_kernel_matches_torch_under_interpreter(interpreter_report: dict[str, Any]) -> None:
    """The kernel vs the torch reference under TRITON_INTERPRET=1. Measured here: bf16 bit-exact (0 ulp) in every
    case; fp32 up to 4 ulps on ~17% of elements, all from silu (numpy's float32 exp vs torch's; the conv sum
    itself is exact); windows bit-exact, idle slots untouched."""
    for name, r in interpreter_report["cases"].items():
        assert r["windows_equal"] == 1.0, name
        if name.startswith("bfloat16"):
            assert r["max_ulp"] <= 1 and r["frac_diff"] < 1e-3, (name, r)
        else:
            assert r["max_ulp"] <= 8, (name, r)


def test_interpreter_comparison_catches_broken_kernels(interpreter_report: dict[str, Any]) -> None:
    """Control: the same comparison on the kernel with its window shift dropped / keep ignored fails."""
    broken = interpreter_report["broken"]
    assert broken["window_not_shifted"]["windows_equal"] == 0.0, broken
    assert broken["keep_ignored"]["max_ulp"] > 1 and broken["keep_ignored"]["frac_diff"] > 1e-3, broken
    assert broken["row_stride_ignored"]["frac_diff"] > 0.5, broken


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_cuda_routes_conv_decode_to_triton(dtype: torch.dtype) -> None:
    """On CUDA the registry runs the Triton decode conv for bf16 (fp32 stays on the exact torch path, with a
    logged reason); it agrees with the torch reference (at most 1 ulp on < 0.1% of elements) and windows are
    exact."""
    xs, weights, windows = (tuple(t.cuda() for t in part) for part in _case(dtype, 4096, 4))
    slots, keep = torch.tensor(SLOTS, device="cuda"), torch.tensor(KEEP, device="cuda").to(dtype)
    tri_pool, ref_pool = tuple(w.clone() for w in windows), tuple(w.clone() for w in windows)
    out = conv_ops.conv_decode_qkv(xs, weights, tri_pool, slots, keep)
    assert REGISTRY.last_backend[conv_ops.CAUSAL_DECODE] == TRITON, REGISTRY.fallbacks[-1:]
    REGISTRY.force(conv_ops.CAUSAL_DECODE, TORCH)
    try:
        ref = conv_ops.conv_decode_qkv(xs, weights, ref_pool, slots, keep)
    finally:
        REGISTRY.force(conv_ops.CAUSAL_DECODE, None)
    real = slots != 0
    for a, b, wa, wb in zip(out, ref, tri_pool, ref_pool, strict=True):
        if dtype == torch.bfloat16:
            ulps = _ulps(a, b)
            assert ulps.max().item() <= 1 and (ulps > 0).float().mean().item() < 1e-3
        else:
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
        assert torch.equal(_bits(wa[slots[real]]), _bits(wb[slots[real]]))
        assert torch.equal(_bits(wa[IDLE]), _bits(wb[IDLE]))


# ---- the layer: wiring and the cached weight cast ----

def _decode_setup(preset: str, dtype: torch.dtype) -> tuple[ServingModel, Any, PackedBatch]:
    cfg = get_preset(preset)
    model = ServingModel(cfg, dtype).load(synthetic_tensors(cfg, seed=0))
    model.allocate_caches(num_pages=16, page_size=8, num_slots=5)
    g = torch.Generator().manual_seed(2)
    for t in model.state_pool.tensors().values():  # type: ignore[union-attr]
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    batch = PackedBatch.build(torch.zeros(4, dtype=torch.long), [1] * 4, start_pos=[5, 0, 7, 2], slots=[1, 3, 2, 5],
                              page_tables=[[1], [2], [3], [4]], page_size=8, is_decode=True)
    return model, model.model.layers[cfg.kda_layers[0]].self_attn, batch


@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_decode_convs_equal_packed_path(preset: str, dtype: torch.dtype) -> None:
    """KimiDeltaAttention.short_convs on a decode batch (decode op) equals the same batch through the packed
    path, outputs and the whole pool bit for bit; a fresh row (start_pos 0) ignores its slot's window."""
    model, layer, batch = _decode_setup(preset, dtype)
    x = torch.randn(4, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    keep = (batch.start_pos > 0).to(dtype)[:, None, None]
    pool = model.state_pool
    assert pool is not None
    before = {k: v.clone() for k, v in pool.tensors().items()}
    calls = REGISTRY.counts[(conv_ops.CAUSAL_DECODE, TORCH)]
    fast = layer.short_convs(layer.in_proj(x)[:3], model._context(batch, None), keep, True)
    assert REGISTRY.counts[(conv_ops.CAUSAL_DECODE, TORCH)] == calls + 1
    after_fast = {k: v.clone() for k, v in pool.tensors().items()}
    for k, v in before.items():
        pool.tensors()[k].copy_(v)
    packed = PackedBatch(**{**batch.__dict__, "is_decode": False})
    slow = layer.short_convs(layer.in_proj(x)[:3], model._context(packed, None), keep, True)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    for k, v in pool.tensors().items():
        assert torch.equal(_bits(after_fast[k]), _bits(v)), k


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def test_decode_conv_stage_is_a_few_ops() -> None:
    """One KDA layer's conv stage in decode: 3 projections + ~25 ops on CPU (the packed gather conv took ~220)."""
    model, layer, batch = _decode_setup("k3-tiny", torch.bfloat16)
    x = torch.randn(4, model.cfg.hidden_size).bfloat16()
    keep = (batch.start_pos > 0).bfloat16()[:, None, None]
    ctx = model._context(batch, None)
    layer.short_convs(layer.in_proj(x)[:3], ctx, keep, True)  # casts and caches the conv weights
    with torch.no_grad(), _CountOps() as decode:
        layer.short_convs(layer.in_proj(x)[:3], ctx, keep, True)
    packed = model._context(PackedBatch(**{**batch.__dict__, "is_decode": False}), None)
    with torch.no_grad(), _CountOps() as general:
        layer.short_convs(layer.in_proj(x)[:3], packed, keep, True)
    assert decode.ops <= 32 and general.ops > 5 * decode.ops, (decode.ops, general.ops)


def test_conv_weights_cast_once_and_recast_after_load() -> None:
    """The activation-dtype conv weights are cast once and reused; loading new weights (copy_) recasts them."""
    cfg = get_preset("k3-tiny")
    tensors = synthetic_tensors(cfg, seed=0)
    model = ServingModel(cfg, torch.bfloat16).load(tensors)
    layer = model.model.layers[cfg.kda_layers[0]].self_attn
    first = layer.conv_weights(torch.bfloat16)
    assert all(a is b for a, b in zip(first, layer.conv_weights(torch.bfloat16), strict=True))
    assert torch.equal(first[0], layer.q_conv1d.weight.bfloat16().reshape(cfg.kda_dim, -1))
    name = next(k for k in tensors if k.endswith(f"layers.{cfg.kda_layers[0]}.self_attn.q_conv1d.weight"))
    model.load({**tensors, name: tensors[name] * 2 + 1})
    again = layer.conv_weights(torch.bfloat16)
    assert torch.equal(again[0], (tensors[name] * 2 + 1).bfloat16().reshape(cfg.kda_dim, -1))
    assert torch.equal(again[1], first[1])
    assert layer.conv_weights(torch.float32)[0].dtype == torch.float32
