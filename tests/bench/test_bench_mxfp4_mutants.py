"""The MXFP4 bench's packed-vs-dequantized decode check bites: on CPU (k3-tiny) the packed GEMM runs its torch
path, and the mutation catalog's fault in that path (`mxfp4.grouped_previous_expert`, applied to the source as
`k3verify mutate` does) turns the check red, while the unmutated path passes. The Triton kernel's catalog
faults are run through the same check under Triton's interpreter in tests/kernels/mxfp4_interpreter_child.py."""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from k3verify.bench import mxfp4
from k3verify.bench import mxfp4_parity as mp
from k3verify.gates.mutation.runner import load_catalog
from k3verify.kernels import mxfp4 as mxfp4_ops
from k3verify.kernels.mxfp4 import torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH
from k3verify.presets import get_preset
from k3verify.serving.runner import ModelRunner

P, S, CTX = 20, 3, 32


def mutated(mutant_id: str) -> Callable[..., Any]:
    """The catalog entry's target function with its fault applied to the module source."""
    mutant = next(m for m in load_catalog() if m.id == mutant_id)
    module_name, qualname = mutant.target.split(":")
    module = importlib.import_module(module_name)
    source = Path(str(module.__file__)).read_text()
    assert mutant.old is not None and mutant.new is not None, mutant.id  # a source-edit entry
    assert source.count(mutant.old) == 1, mutant.id
    faulty = types.ModuleType(f"{module_name}_mutant")
    exec(compile(source.replace(mutant.old, mutant.new), f"<{mutant.id}>", "exec"), faulty.__dict__)
    fn: Callable[..., Any] = getattr(faulty, qualname)
    return fn


@pytest.fixture(scope="module")
def decode_check() -> Iterator[Callable[[], dict[str, Any]]]:
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors

    cfg, device = get_preset("k3-tiny"), torch.device("cpu")
    tensors = synthetic_tensors(cfg, 0, device=device)
    ids = torch.randint(0, cfg.vocab_size, (P + S,), generator=torch.Generator().manual_seed(3))
    gold = mxfp4.gold_logits(cfg, tensors, ids, device)[P - 1:P + S]
    models = {mode: mxfp4.build_model(cfg, tensors, mode, device)[0] for mode in ("packed", "cached")}
    runs = {mode: mp.decode_run(ModelRunner(model, num_pages=4, page_size=16, num_slots=2, max_context=CTX),
                                ids, P, S, CTX) for mode, model in models.items()}

    def check() -> dict[str, Any]:
        return mp.packed_vs_dequantized("bench.mxfp4.decode_packed_vs_dequantized", models["cached"],
                                        runs["cached"], models["packed"], runs["packed"], gold, "test")
    yield check


def test_unmutated_packed_path_passes(decode_check: Callable[[], dict[str, Any]]) -> None:
    result = decode_check()
    assert result["status"] == "pass" and result["control_metric"] > result["bar"], result
    assert REGISTRY.last_backend[mxfp4_ops.GROUPED_MM] == TORCH


def test_catalog_fault_in_the_packed_gemm_fails_the_decode_check(decode_check: Callable[[], dict[str, Any]]) -> None:
    """Each expert's rows multiplied by the previous expert's weights: only the packed side changes."""
    REGISTRY.register(mxfp4_ops.GROUPED_MM, TORCH, mutated("mxfp4.grouped_previous_expert"))
    try:
        result = decode_check()
    finally:
        REGISTRY.register(mxfp4_ops.GROUPED_MM, TORCH, torch_ref.grouped_mm_torch)
    assert result["status"] == "fail" and result["metric"] > 10 * result["bar"], result
    assert result["noise_grouped_vs_loop_rms"] < result["bar"], result  # the fault cannot widen its own bar
