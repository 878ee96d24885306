"""Runs in a child process of tests/kernels/test_kernels_mxfp4_grouped.py with TRITON_INTERPRET=1: the Triton
MXFP4 grouped GEMM on Triton's CPU interpreter (patched by triton_interp.py to round and multiply bf16 as
the GPU does) against its torch reference, the faults of the CUDA mutation catalog applied to the kernel's
source, the serving MoE routed through the kernel, the MXFP4 bench's decode check with the kernel and with each
catalog fault, and the CUDA check's own code on small shapes.

    TRITON_INTERPRET=1 python -c "import mxfp4_interpreter_child as c; c.main(TMP)"   # prints REPORT {json}
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import zlib
from pathlib import Path
from typing import Any

import torch

GROUP = 32
# (name, rows per expert, N, K): odd counts, zero-row experts first / last / between, N and K off the tiles
# (a K of 96 = 3 scale groups inside one 128-wide K block), experts spanning several row tiles, more row
# tiles than one program group (8) walks; the mean rows per expert picks the decode (16-row), mid (64) and
# prefill (128) tiles
CASES = (
    ("decode.odd", (1, 0, 3, 0, 0, 2, 1, 0), 40, 96),
    ("decode.many_groups", tuple(i % 3 for i in range(40)), 72, 64),
    ("decode.zero_edges", (0, 0, 5, 1, 0), 64, 64),
    ("single_row", (1,), 16, 32),
    ("mid.multi_tile", (150, 0, 3, 77), 72, 128),
    ("prefill.multi_tile", (300, 1, 0, 260), 136, 160),
)
MUTANT_CASES = ("decode.odd", "prefill.multi_tile")


def case(name: str, counts: tuple[int, ...], N: int, K: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    E = len(counts)
    x = torch.randn(sum(counts), K, generator=g).bfloat16()
    codes = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 131, (E, N, K // GROUP), generator=g, dtype=torch.uint8)
    return x, codes, scales, torch.tensor(counts).cumsum(0).to(torch.int32)


def rms(ref: torch.Tensor, cand: torch.Tensor) -> float:
    d = cand.double() - ref.double()
    return float(d.norm() / ref.double().norm())


def compare(launch: Any, name: str, counts: tuple[int, ...], N: int, K: int,
            fault: Any = None) -> dict[str, float]:
    """The kernel (optionally on faulted inputs) vs the torch reference in bf16 and in fp64."""
    from k3verify.kernels.mxfp4 import torch_ref

    x, codes, scales, offs = case(name, counts, N, K)
    args = (x, codes, scales) if fault is None else fault(x, codes, scales)
    out = launch(*args, offs, GROUP)
    ref = torch_ref.grouped_mm_torch(x, codes, scales, offs, GROUP)
    gold = torch_ref.grouped_mm_torch(x.double(), codes, scales, offs, GROUP)
    return {"vs_fp64": rms(gold, out), "vs_torch_bf16": rms(ref, out), "reference_noise": rms(gold, ref),
            "equal_fraction": float((out == ref).float().mean()), "finite": float(bool(out.isfinite().all()))}


def readout(launch: Any) -> dict[str, float]:
    """One-hot rows read the decoded weights out exactly: every byte value under scales from 2^-127 to 2^125."""
    from k3verify.kernels.mxfp4 import torch_ref

    E, N, K = 2, 256, 64
    codes = torch.arange(256, dtype=torch.uint8).repeat(E, K // 2, 1).transpose(1, 2).contiguous()  # [E, N, K/2]
    exps = torch.tensor([0, 1, 100, 126, 127, 128, 200, 252], dtype=torch.uint8)
    scales = exps[torch.arange(E * N * 2) % 8].view(E, N, K // GROUP)
    x = torch.eye(K).repeat(E, 1).bfloat16()  # expert e's rows read its columns
    offs = torch.tensor([K, 2 * K], dtype=torch.int32)
    out = launch(x, codes, scales, offs, GROUP)
    dense = torch.cat([torch_ref.dequantize_torch(codes[e], scales[e], torch.bfloat16, GROUP).t() for e in range(E)])
    return {"exact": float(torch.equal(out, dense))}  # value equality: a sum reads the code -0 out as +0


def faulted_kernels(tmp: str) -> dict[str, Any]:
    """Each CUDA catalog entry that targets the kernel module, applied to its source: id -> launch function."""
    from k3verify.gates.mutation.runner import load_catalog
    from k3verify.kernels.mxfp4 import grouped_kernel, grouped_launch

    source = Path(grouped_kernel.__file__).read_text()
    out: dict[str, Any] = {}
    for m in load_catalog():
        if not m.target.startswith(grouped_kernel.__name__ + ":"):
            continue
        if source.count(m.old) != 1:
            raise RuntimeError(f"mutant {m.id}: snippet {m.old!r} is not in the kernel exactly once")
        path = Path(tmp) / f"mxfp4_{m.id.replace('.', '_')}.py"
        path.write_text(source.replace(m.old, m.new))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)

        out[m.id] = functools.partial(grouped_launch.launch, module)
    return out


def serving_packed_vs_cached() -> dict[str, float]:
    """k3-tiny in bf16: prefill logits with the packed experts through the Triton kernel vs dequantized experts."""
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors
    from k3verify.kernels import mxfp4
    from k3verify.kernels.registry import REGISTRY, TRITON
    from k3verify.presets import get_preset
    from k3verify.serving.batch import PackedBatch
    from k3verify.serving.model import ServingModel

    cfg = get_preset("k3-tiny")
    tensors = synthetic_tensors(cfg)
    batch = PackedBatch.build(torch.arange(29) * 89 % 4000, [11, 18])
    cached = ServingModel(cfg, torch.bfloat16, "cpu", "cached").load(tensors).prefill(batch, all_logits=True)
    REGISTRY.force(mxfp4.GROUPED_MM, TRITON)
    try:
        packed = ServingModel(cfg, torch.bfloat16, "cpu", "packed").load(tensors).prefill(batch, all_logits=True)
        routed = REGISTRY.last_backend[mxfp4.GROUPED_MM] == TRITON
    finally:
        REGISTRY.force(mxfp4.GROUPED_MM, None)
    assert cached.all_logits is not None and packed.all_logits is not None
    return {"rms": rms(cached.all_logits, packed.all_logits), "routed_triton": float(routed)}


BENCH_FAULT = "kernel.mxfp4.triton_wrong_expert_offset"  # one fault: every launch is interpreted (seconds each)


def bench_decode(faulted: dict[str, Any]) -> dict[str, dict[str, float | str]]:
    """The MXFP4 bench's decode check (bench/mxfp4_parity.py) on k3-tiny with the packed GEMM on the interpreted
    Triton kernel: as it is, and with one CUDA catalog fault of the kernel registered in its place (the torch
    path's fault: tests/bench/test_bench_mxfp4_mutants.py)."""
    from k3verify.bench import mxfp4 as bench
    from k3verify.bench import mxfp4_parity as mp
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors
    from k3verify.kernels import mxfp4
    from k3verify.kernels.mxfp4 import grouped_launch
    from k3verify.kernels.registry import REGISTRY, TRITON
    from k3verify.presets import get_preset
    from k3verify.serving.runner import ModelRunner

    P, S, ctx = 6, 1, 16
    cfg, cpu = get_preset("k3-tiny"), torch.device("cpu")
    tensors = synthetic_tensors(cfg)
    ids = torch.arange(P + S) * 97 % cfg.vocab_size
    gold = bench.gold_logits(cfg, tensors, ids, cpu)[P - 1:P + S]
    models = {mode: bench.build_model(cfg, tensors, mode, cpu)[0] for mode in ("packed", "cached")}
    runs = {mode: mp.decode_run(ModelRunner(model, num_pages=4, page_size=16, num_slots=2, max_context=ctx), ids,
                                P, S, ctx) for mode, model in models.items()}
    out: dict[str, dict[str, float | str]] = {}
    REGISTRY.force(mxfp4.GROUPED_MM, TRITON)
    try:
        for name, launch in {"kernel": grouped_launch.grouped_mm_triton, BENCH_FAULT: faulted[BENCH_FAULT]}.items():
            REGISTRY.register(mxfp4.GROUPED_MM, TRITON, launch)
            REGISTRY.last_backend.pop(mxfp4.GROUPED_MM, None)
            r = mp.packed_vs_dequantized("bench.mxfp4.decode_packed_vs_dequantized", models["cached"],
                                         runs["cached"], models["packed"], runs["packed"], gold, "interpreter")
            out[name] = {"status": r["status"], "metric": r["metric"], "bar": r["bar"],
                         "control": r["control_metric"], "backend": REGISTRY.last_backend[mxfp4.GROUPED_MM]}
    finally:
        REGISTRY.register(mxfp4.GROUPED_MM, TRITON, grouped_launch.grouped_mm_triton, accepts=grouped_launch.accepts,
                          available=grouped_launch.available)
        REGISTRY.force(mxfp4.GROUPED_MM, None)
    return out


def check_dry_run() -> dict[str, Any]:
    """kernel.mxfp4.grouped_vs_torch's own code (CUDA-only) on small shapes, the Triton path forced."""
    from k3verify.gates import CheckContext
    from k3verify.gates.checks.kernels import mxfp4_grouped as serving_mxfp4
    from k3verify.gates.core.check import REGISTRY as CHECKS
    from k3verify.gates.core.evaluate import evaluate_trial
    from k3verify.kernels import mxfp4
    from k3verify.kernels.mxfp4 import grouped_launch
    from k3verify.kernels.registry import REGISTRY, TRITON
    from k3verify.target import resolve_target

    setattr(serving_mxfp4, "CASES", CASES[:2])  # noqa: B010 (the check's module constant, small shapes)
    grouped_launch.available = lambda: None  # the interpreter stands in for CUDA
    check = CHECKS.get("kernel.mxfp4.grouped_vs_torch")
    ctx = CheckContext(resolve_target("k3-tiny"), torch.device("cpu"), 0, torch.Generator().manual_seed(0), "quick")
    REGISTRY.force(mxfp4.GROUPED_MM, TRITON)
    try:
        result = evaluate_trial(check, check.fn(ctx))
    finally:
        REGISTRY.force(mxfp4.GROUPED_MM, None)
    assert result.control is not None
    return {"status": str(result.status), "metric": result.metric, "control": result.control.status,
            "keys": sorted(result.per_key), "reference_noise": result.metrics["reference_noise"]}


def main(tmp: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from triton_interp import patch_interpreter

    patch_interpreter()
    from k3verify.gates.checks.kernels.mxfp4_grouped import swap_nibbles
    from k3verify.kernels.mxfp4 import grouped_launch

    kernel = grouped_launch.grouped_mm_triton
    report: dict[str, Any] = {"cases": {}, "controls": {}, "mutants": {}}
    for name, counts, N, K in CASES:
        report["cases"][name] = compare(kernel, name, counts, N, K)
    report["readout"] = readout(kernel)
    controls = {"nibbles_high_first": lambda x, c, s: (x, swap_nibbles(c), s),
                "scale_bias_126": lambda x, c, s: (x, c, s + 1)}
    for cname, fault in controls.items():
        for name, counts, N, K in CASES[:2]:
            report["controls"][f"{cname}.{name}"] = compare(kernel, name, counts, N, K, fault)
    faulted = faulted_kernels(tmp)
    for mid, launch in faulted.items():
        for name, counts, N, K in (c for c in CASES if c[0] in MUTANT_CASES):
            report["mutants"][f"{mid}.{name}"] = compare(launch, name, counts, N, K)
    report["serving"] = serving_packed_vs_cached()
    report["bench_decode"] = bench_decode(faulted)
    report["check"] = check_dry_run()
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
