"""The decode-sized MoE combine (kernels/moe/decode_kernel.py): the Triton kernels under the interpreter vs a
per-pair torch loop written here (F.linear per pair, the GLU, the route weight, each token's terms in route
order), controls that must fail, the refusal reasons, and on CUDA the combine's choice of kernels."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from triton_interp import broken_variant, child_report  # tests/kernels, on sys.path for pytest and the child

from k3verify.kernels.moe import decode_launch
from k3verify.kernels.moe.decode_launch import GluSpec

Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _glu(spec: GluSpec, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    from k3verify.serving.layers.mlp import silu_glu, situ_glu

    return silu_glu(g, u) if spec.kind == "silu" else situ_glu(g, u, spec.beta, spec.linear_beta)


def _case(E: int, D: int, I: int, k: int, T: int, seed: int, device: str = "cpu") -> Case:
    """x_in as a row-strided view (a wider activation's first D columns), stacked experts, sigmoid top-k routing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D + 8, generator=g).bfloat16()[:, :D]
    w13 = (torch.randn(E, 2 * I, D, generator=g) * D**-0.5).bfloat16()
    w2 = (torch.randn(E, D, I, generator=g) * I**-0.5).bfloat16()
    weights, idx = torch.randn(T, E, generator=g).sigmoid().topk(k, dim=1)
    return tuple(t.to(device) for t in (x, w13, w2, weights.float(), idx))  # type: ignore[return-value]


def reference(case: Case, spec: GluSpec) -> torch.Tensor:
    x, w13, w2, weights, idx = case
    I = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            g, u = F.linear(x[t:t + 1], w13[e]).split(I, dim=-1)
            out[t] += (F.linear(_glu(spec, g, u), w2[e]).float() * weights[t, j])[0]
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


SPECS = {"silu": GluSpec("silu"), "situ": GluSpec("situ", 2.0, 3.0), "situ-nolin": GluSpec("situ", 1.5)}
# (E, D, I, k, T): one token; a few; more rows per expert than one 16-row block; the most pairs the kernels take
SHAPES = {"t1": (8, 64, 32, 2, 1), "t5": (8, 72, 48, 2, 5), "blocks": (4, 64, 32, 2, 40), "max": (64, 32, 16, 8, 64),
          "e12": (12, 48, 80, 3, 7)}  # expert count, width and intermediate no powers of two (a k3-skew-like shape)
GRIDS = {"all": decode_launch.Tiles(64, 4, 4), "compact": decode_launch.Tiles(64, 4, 4, compact=True),
         "cols_first": decode_launch.Tiles(64, 4, 4, cols_first=True),
         "compact_cols_first": decode_launch.Tiles(64, 4, 4, compact=True, cols_first=True)}
BROKEN = {  # controls: the kernel's own source with one fault, compared the same way (compact grid)
    "first_pair_dropped": ("rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1",
                           "rank = tl.cumsum(hit.to(tl.int32), axis=0)"),
    "only_first_block": ("r = block * BLOCK_M + tl.arange(0, BLOCK_M)", "r = tl.arange(0, BLOCK_M)"),
    "route_weight_dropped": ("* route_w[:, None]", "* 1.0"),
    "silu_without_sigmoid": ("a = (g * tl.sigmoid(g))", "a = (g * 0.5)"),
    "token_is_pair": ("(pairs // TOP_K)", "(pairs // 1)"),
    "expert_list_drops_its_last": ("mask=(e >= count) & (e < SLOTS)", "mask=(e >= count - 1) & (e < SLOTS)"),
}


def _interpreter_report(tmp: str) -> dict[str, Any]:
    """Runs in the subprocess (TRITON_INTERPRET=1): the kernels and their broken variants vs the loop."""
    from triton_interp import patch_interpreter

    patch_interpreter()
    from k3verify.kernels.moe import decode_kernel

    report: dict[str, Any] = {"cases": {}, "broken": {}}
    for shape, dims in SHAPES.items():
        for name, spec in SPECS.items():
            if shape == "max" and name != "silu":
                continue
            case = _case(*dims, seed=len(report["cases"]))
            ref = reference(case, spec)
            for grid, tiles in GRIDS.items():
                got = decode_launch.combine(*case, spec, mod=decode_kernel, tiles=tiles)
                report["cases"][f"{shape}-{name}-{grid}"] = {
                    "rel": _rel(got, ref), "pairs": case[4].numel(),
                    "max_rows_per_expert": int(torch.bincount(case[4].flatten()).max())}
    for shape in ("t1", "t5"):  # the finish launch with the shared expert's output added (the layer's call)
        case = _case(*SHAPES[shape], seed=7)
        shared = torch.randn(case[0].shape, generator=torch.Generator().manual_seed(8)).bfloat16()
        ref = reference(case, SPECS["silu"]).to(torch.bfloat16) + shared
        for grid, tiles in GRIDS.items():
            got = decode_launch.combine(*case, SPECS["silu"], mod=decode_kernel, tiles=tiles, add=shared)
            report["cases"][f"{shape}-silu-{grid}-added"] = {
                "rel": _rel(got.float(), ref.float()), "pairs": case[4].numel(), "dtype": str(got.dtype),
                "max_rows_per_expert": int(torch.bincount(case[4].flatten()).max())}
        module = broken_variant(decode_kernel, f"shared_not_added_{shape}",
                                "acc = acc.to(shared.dtype).to(tl.float32) + shared.to(tl.float32)",
                                "acc = acc.to(shared.dtype).to(tl.float32)", tmp)
        got = decode_launch.combine(*case, SPECS["silu"], mod=module, tiles=GRIDS["compact"], add=shared)
        report["broken"][f"shared_not_added_{shape}"] = _rel(got.float(), ref.float())
    case = _case(*SHAPES["blocks"], seed=99)
    module = broken_variant(decode_kernel, "cols_first_axes_crossed",
                            "return tl.program_id(0) if COLS_FIRST else tl.program_id(1)", "return tl.program_id(1)",
                            tmp)
    got = decode_launch.combine(*case, SPECS["silu"], mod=module, tiles=GRIDS["cols_first"])
    report["broken"]["cols_first_axes_crossed"] = _rel(got, reference(case, SPECS["silu"]))
    for name, (old, new) in BROKEN.items():
        module = broken_variant(decode_kernel, name, old, new, tmp)
        report["broken"][name] = _rel(decode_launch.combine(*case, SPECS["silu"], mod=module, tiles=GRIDS["compact"]),
                                      reference(case, SPECS["silu"]))
    return report


@pytest.fixture(scope="module")
def interpreter_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("triton", reason="triton is not installed: the interpreter test needs it")
    return child_report("test_kernels_moe_decode", "_interpreter_report",
                        str(tmp_path_factory.mktemp("moe_decode_interp")))


def test_decode_combine_matches_the_loop_under_interpreter(interpreter_report: dict[str, Any]) -> None:
    """Measured here: 0 in every case (the interpreter's dots are exact fp32 sums, like CPU F.linear at these
    widths; both round each GEMM output to bf16 at the same step), SiLU and SiTU with and without its linear
    beta, 1 to 64 tokens, experts with more rows than one 16-row block, the 512-pair maximum's pad; the grid over
    all experts and the compact grid over the touched ones alike."""
    cases = interpreter_report["cases"]
    assert cases["blocks-silu-all"]["max_rows_per_expert"] > decode_launch.BLOCK_M, cases["blocks-silu-all"]
    assert cases["max-silu-compact"]["pairs"] == decode_launch.MAX_PAIRS
    for name, r in cases.items():
        assert r["rel"] < 1e-3, (name, r)
    assert sum(name.endswith("-added") for name in cases) == 2 * len(GRIDS)
    assert all(r["dtype"] == "torch.bfloat16" for name, r in cases.items() if name.endswith("-added"))


def test_interpreter_comparison_catches_broken_decode_kernels(interpreter_report: dict[str, Any]) -> None:
    """Controls: a rank off by one, rows past the first 16 never computed, the route weight dropped, SiLU
    without its sigmoid, rows read from the wrong token, an expert list that drops its highest expert and the
    column-first grid reading its column block from the expert axis all fail the same comparison (a variant that
    reads past its rows may give inf or NaN: that fails too)."""
    for name, rel in interpreter_report["broken"].items():
        assert not rel <= 5e-2, (name, rel)


def test_decode_refusals_name_the_reason() -> None:
    x, w13, w2, weights, idx = _case(*SHAPES["t5"], seed=0)
    assert "bf16" in str(decode_launch.accepts(x.float(), w13, w2, weights, idx, SPECS["silu"]))
    assert "GLU" in str(decode_launch.accepts(x, w13, w2, weights, idx, None))
    assert "shapes" in str(decode_launch.accepts(x, w13[:, :10], w2, weights, idx, SPECS["silu"]))
    assert "cpu" in str(decode_launch.accepts(x, w13, w2, weights, idx, SPECS["silu"]))
    assert decode_launch.too_large(decode_launch.MAX_PAIRS + 1) and not decode_launch.too_large(decode_launch.MAX_PAIRS)
    with pytest.raises(ValueError, match="unknown GLU"):
        GluSpec("gelu")


@pytest.mark.gpu
def test_cuda_decode_combine_vs_loop_and_routing() -> None:
    """On CUDA: the kernels against the loop at a kl-48b-like width (bf16 GEMM outputs, different accumulation
    order: ~1e-3 RMS), the compact grid bit for bit equal to the grid over all experts, and the registry's combine
    runs them for decode-sized steps, the grouped GEMMs past MAX_PAIRS."""
    from types import SimpleNamespace

    from k3verify.kernels.moe import grouped

    for T in (1, 16, 64):
        case = _case(64, 2304, 1024, 8, T, seed=T, device="cuda")
        ref = reference(case, SPECS["silu"])
        assert _rel(decode_launch.combine(*case, SPECS["silu"]), ref) < 1e-2
        every = decode_launch.combine(*case, SPECS["silu"], tiles=GRIDS["all"])
        for grid in ("compact", "cols_first", "compact_cols_first"):
            assert torch.equal(decode_launch.combine(*case, SPECS["silu"], tiles=GRIDS[grid]), every), (T, grid)
        for pairs in (8, 40, 512):  # every size's pick writes the same bits: a pair's result never depends on its batch
            picked = decode_launch.pick_tiles(pairs)
            assert torch.equal(decode_launch.combine(*case, SPECS["silu"], tiles=picked), every), (T, picked)
    x, w13, w2, weights, idx = _case(64, 256, 128, 8, 65, seed=1, device="cuda")
    moe = SimpleNamespace(stacked_weights=lambda: (w13, w2), glu=SPECS["silu"],
                          act=lambda g, u: _glu(SPECS["silu"], g, u))
    before = grouped.PATHS.copy()
    grouped.combine_grouped(moe, x[:64], weights[:64], idx[:64])
    grouped.combine_grouped(moe, x, weights, idx)
    assert grouped.PATHS["decode"] == before["decode"] + 1 and grouped.PATHS["grouped"] == before["grouped"] + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_adds_its_shared_expert_in_the_combine_bit_for_bit(dtype: torch.dtype) -> None:
    """SparseMoE.forward hands the shared expert's output to the combine (`add`): on the torch path the same bits
    as the routed sum cast to the activation dtype plus the shared expert, as the layer added them before."""
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors
    from k3verify.kernels.moe import moe_combine
    from k3verify.presets import get_preset
    from k3verify.serving.layers.moe import SparseMoE
    from k3verify.serving.model import ServingModel

    cfg = get_preset("kl-tiny")
    model = ServingModel(cfg, dtype).load(synthetic_tensors(cfg, seed=0))
    moe = next(m for m in model.modules() if isinstance(m, SparseMoE))
    assert not (moe.latent or moe.is_packed)
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        weights, idx = moe.gate(x)
        old = moe_combine(moe, x, weights, idx).to(dtype) + moe.shared_experts(x)
        assert torch.equal(moe(x), old)
        assert not torch.equal(moe_combine(moe, x, weights, idx, add=moe.shared_experts(x) * 2), old)
