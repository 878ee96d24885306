"""kernels/mxfp4 grouped GEMM: the torch reference is dequantize + one F.linear per expert, the Triton kernel
(run by Triton's CPU interpreter in a child process, mxfp4_interpreter_child.py) matches it, faulted inputs
and every CUDA catalog mutant of the kernel do not, and on CUDA the registry runs the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import k3verify
from k3verify.checkpoint import mxfp4 as ckpt_mxfp4
from k3verify.gates.mutation.runner import load_catalog
from k3verify.kernels import mxfp4
from k3verify.kernels.mxfp4 import grouped_launch, torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON

BAR = 3.3e-3  # kernel.mxfp4.grouped_vs_torch's bar (2x the reference's own bf16 noise)


def _case(seed: int, counts: list[int], N: int, K: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), K, generator=g).to(dtype)
    codes = torch.randint(0, 256, (len(counts), N, K // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 131, (len(counts), N, K // 32), generator=g, dtype=torch.uint8)
    return x, codes, scales, torch.tensor(counts).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_reference_is_checkpoint_dequant_then_linear_per_expert(dtype: torch.dtype) -> None:
    """Through the registry on CPU: each expert's rows times its checkpoint-decoded weights, bit for bit;
    experts without rows (first, middle, last) are skipped."""
    counts = [0, 3, 0, 0, 5, 1, 0]
    x, codes, scales, offs = _case(1, counts, 24, 64, dtype)
    y = mxfp4.grouped_mm(x, codes, scales, offs, 32)
    assert REGISTRY.last_backend[mxfp4.GROUPED_MM] == TORCH and y.dtype == dtype and y.shape == (9, 24)
    start = 0
    for e, n in enumerate(counts):
        w = ckpt_mxfp4.dequantize(codes[e], scales[e], torch.float32, 32).to(dtype)
        assert torch.equal(y[start:start + n], F.linear(x[start:start + n], w)), e
        start += n


def test_torch_reference_refuses_offsets_that_do_not_cover_the_rows() -> None:
    x, codes, scales, _ = _case(2, [2, 2], 8, 32, torch.float32)
    for offs, match in (([2, 3], "end at row 3"), ([3, 2], "non-decreasing"), ([2, 5], "within 4 rows")):
        with pytest.raises(ValueError, match=match):
            torch_ref.grouped_mm_torch(x, codes, scales, torch.tensor(offs, dtype=torch.int32), 32)
    with pytest.raises(ValueError, match="one end per expert"):
        torch_ref.grouped_mm_torch(x, codes, scales, torch.tensor([4], dtype=torch.int32), 32)


def test_fast_path_refusals_name_the_reason() -> None:
    """fp32 activations, a wrong scale shape, int64 offsets and CPU tensors are refused with the value."""
    x, codes, scales, offs = _case(3, [2, 2], 8, 64, torch.bfloat16)

    def reason(*args: Any) -> str:
        return str(grouped_launch.accepts(*args))
    assert "got torch.float32" in reason(x.float(), codes, scales, offs, 32)
    assert "scales (2, 8, 3)" in reason(x, codes, scales[..., :1].expand(2, 8, 3), offs, 32)
    assert "offs must be int32 [2]; got torch.int64" in reason(x, codes, scales, offs.long(), 32)
    assert "group 24" in reason(x, codes, scales, offs, 24)
    assert "not all on cpu" in reason(x, codes, scales, offs, 32)
    if not torch.cuda.is_available():
        assert grouped_launch.available() == "CUDA is not available"


def test_tiles_follow_rows_per_expert() -> None:
    """Decode batches (<= 16 rows per expert) take 16-row tiles, prefill 128; K blocks hold whole groups."""
    assert grouped_launch.pick_tiles(16, 64, 32).block_m == 16
    assert grouped_launch.pick_tiles(64 * 16, 64, 32).block_m == 16
    assert grouped_launch.pick_tiles(8192 * 16, 64, 32).block_m == 128
    assert all(grouped_launch.pick_tiles(m, 8, 32).block_k % 32 == 0 for m in (1, 100, 10_000))


# ---- the Triton kernel under the interpreter (a subprocess: TRITON_INTERPRET must precede the import) ----

@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("triton", reason="triton is not installed: the interpreter test needs it")
    tmp = str(tmp_path_factory.mktemp("mxfp4_interp"))
    root = str(Path(k3verify.__file__).resolve().parents[1])
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import mxfp4_interpreter_child as c; c.main(sys.argv[2])")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), tmp], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


def test_triton_kernel_matches_torch_under_interpreter(report: dict[str, Any]) -> None:
    """Odd row counts, zero-row experts, K off the block and across scale groups, multi-tile experts, more tiles
    than one program group, all three tile shapes: within the CUDA check's bar of the fp64 reference, as
    close to it as the torch bf16 path. Measured: bit-identical to the torch bf16 path in every case (fp32
    sums, one rounding each)."""
    for name, r in report["cases"].items():
        assert r["finite"] == 1.0 and r["vs_fp64"] < BAR, (name, r)
        assert r["vs_fp64"] <= 1.05 * r["reference_noise"] and r["vs_torch_bf16"] < 1e-3, (name, r)


def test_every_byte_and_scale_decodes_exactly(report: dict[str, Any]) -> None:
    """One-hot rows read the decoded weights out: all 256 bytes under scales 2^-127..2^125, exactly (-0 reads
    out as +0 through any sum)."""
    assert report["readout"]["exact"] == 1.0


def test_interpreter_comparison_catches_faulted_inputs(report: dict[str, Any]) -> None:
    """Control: codes read high nibble first, and scales read with exponent bias 126, are far outside the bar."""
    assert len(report["controls"]) == 4
    for name, r in report["controls"].items():
        assert r["vs_fp64"] > 0.5, (name, r)


def test_every_cuda_mutant_of_the_kernel_breaks_the_comparison(report: dict[str, Any]) -> None:
    """Each catalog entry faulting kernels/mxfp4/grouped_kernel.py (CUDA-only there), applied here to the
    interpreted kernel, leaves the bar far behind on decode and prefill tiles."""
    ids = {m.id for m in load_catalog() if m.target.startswith("k3verify.kernels.mxfp4.grouped_kernel:")}
    assert len(ids) == 4
    assert {k.rsplit(".", 2)[0] for k in report["mutants"]} == ids
    for name, r in report["mutants"].items():
        assert r["vs_fp64"] > 30 * BAR, (name, r)


def test_serving_moe_runs_the_kernel_and_matches_dequantized_experts(report: dict[str, Any]) -> None:
    """k3-tiny bf16 prefill logits, packed experts through the interpreted Triton kernel vs the cached
    (dequantized) experts: the registry ran Triton, and the logits agree to bf16 rounding."""
    assert report["serving"]["routed_triton"] == 1.0
    assert report["serving"]["rms"] < 1e-2, report["serving"]


def test_bench_decode_check_passes_the_kernel_and_fails_a_catalog_fault(report: dict[str, Any]) -> None:
    """`k3verify bench --mxfp4`'s decode check (packed vs dequantized, routes pinned, bar from the dequantized
    model's own noise) on k3-tiny through the interpreted kernel: green as it is, red with the kernel reading
    the previous expert's weights (so the H200 run's decode result can fail for a kernel bug)."""
    runs = report["bench_decode"]
    assert set(runs) == {"kernel", "kernel.mxfp4.triton_wrong_expert_offset"}
    assert all(r["backend"] == "triton" for r in runs.values()), runs
    ok, bad = runs["kernel"], runs["kernel.mxfp4.triton_wrong_expert_offset"]
    assert ok["status"] == "pass" and ok["control"] > ok["bar"] > ok["metric"], runs
    assert bad["status"] == "fail" and bad["metric"] > 10 * bad["bar"], runs


def test_the_cuda_check_code_passes_with_a_failing_control(report: dict[str, Any]) -> None:
    """kernel.mxfp4.grouped_vs_torch itself (its inputs, routing proof, fp64 reference, control, metrics) on
    small shapes: pass, control caught, the preset's own experts among the keys."""
    r = report["check"]
    assert r["status"] == "pass" and r["control"] == "fail", r
    assert {"decode.odd", "decode.many_groups", "preset.w13", "preset.w2"} == set(r["keys"])
    assert 1e-3 < r["reference_noise"] < BAR / 1.5


@pytest.mark.gpu
def test_cuda_runs_the_triton_kernel() -> None:
    """On CUDA the registry runs the Triton kernel; it stays within the bar of the fp64 reference."""
    for counts, N, K in (([1, 0, 2, 1], 512, 3584), ([300, 0, 1, 129], 1072, 3072)):
        x, codes, scales, offs = (t.cuda() for t in _case(4, counts, N, K, torch.bfloat16))
        y = mxfp4.grouped_mm(x, codes, scales, offs, 32)
        assert REGISTRY.last_backend[mxfp4.GROUPED_MM] == TRITON, REGISTRY.fallbacks[-1:]
        gold = torch_ref.grouped_mm_torch(x.double(), codes, scales, offs, 32)
        assert float((y.double() - gold).norm() / gold.norm()) < BAR
