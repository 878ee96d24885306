"""Cached models and small helpers for the parity checks (gates/checks/) and what reuses their trials.

Weights come from one place, `checkpoint_tensors(ctx)` (the target's checkpoint, read lazily), so the oracle,
transformers' model and the serving model load the very same tensors. Everything is cached per run in ctx.cache.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from k3verify.checkpoint.loader import load_into
from k3verify.checkpoint.names import module_specs
from k3verify.config import ModelConfig
from k3verify.gates.core.check import CheckContext, SkipCheck
from k3verify.gates.core.evidence import SIZE_SKIP
from k3verify.gates.shared.patch import patched
from k3verify.gates.shared.route_pin import PinStats, RouteRecord, pin_routes, record_routes
from k3verify.kernels.registry import REGISTRY, TORCH
from k3verify.oracle.hf_kimi_linear import build_hf_model
from k3verify.oracle.k3_reference import K3Reference
from k3verify.peers.gguf_target import tag_model
from k3verify.plan.device_fit import device_memory_gib, require_fit
from k3verify.serving.batch import PackedBatch
from k3verify.serving.context import ForwardContext
from k3verify.serving.model import ServingModel

SERVING_CONFIG = "serving.config"  # cache key: the config the serving stack is built from (default ctx.cfg)


def single_thread(fn: Callable[[CheckContext], Any]) -> Callable[[CheckContext], Any]:
    """Run a CPU check with one torch thread (restored after). These models are tiny: on a shared few-core
    runner spinning OpenMP threads make every small fp32 GEMM orders of magnitude slower. Reference,
    candidate and control of a check all run under the same setting."""

    @functools.wraps(fn)
    def wrapper(ctx: CheckContext) -> Any:
        if ctx.device.type != "cpu":
            return fn(ctx)
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(ctx)
        finally:
            torch.set_num_threads(saved)

    return wrapper


def _cached(ctx: CheckContext, key: str, build: Callable[[], Any]) -> Any:
    if key not in ctx.cache:
        ctx.cache[key] = build()
    return ctx.cache[key]


def checkpoint_tensors(ctx: CheckContext) -> Mapping[str, torch.Tensor]:
    """The target checkpoint's tensors by checkpoint name (read lazily, shared by every stack)."""
    return _cached(ctx, "tensors", ctx.target.weights)


def serving_config(ctx: CheckContext) -> ModelConfig:
    """The config the serving stack is built from: ctx.cfg, unless ctx.cache[SERVING_CONFIG] holds another
    (the config-field coverage test perturbs one field in the serving stack alone; the oracle keeps ctx.cfg)."""
    cfg: ModelConfig = ctx.cache.get(SERVING_CONFIG, ctx.cfg)
    return cfg


# A whole model above this is not built for a check: a real-size target (kl-48b-8l: 27.7 GB in bf16) builds only
# its served model; the oracle runs one layer at a time (model.layerwise.*) and the gold comes from transformers.
WHOLE_MODEL_BYTES = 16 << 30


@functools.cache
def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the text model, MXFP4 experts counted dense (two values per packed byte)."""
    total = 0
    for name, spec in module_specs(cfg).items():
        if name.endswith(".weight_scale"):
            continue
        total += math.prod(spec.shape) * (2 if name.endswith(".weight_packed") else 1)
    return total


def whole_model_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return parameter_count(cfg) * torch.empty((), dtype=dtype).element_size()


def require_whole_model(ctx: CheckContext, what: str, dtype: torch.dtype) -> None:
    """Skip (with the sizes printed) a check that would build `what` whole in `dtype` at real size."""
    need = whole_model_bytes(ctx.cfg, dtype)
    if need > WHOLE_MODEL_BYTES:
        raise SkipCheck(f"{SIZE_SKIP} {what} in {_dtype_name(dtype)} would hold {need / 1e9:.1f} GB (more than the "
                        f"{WHOLE_MODEL_BYTES / 1e9:.1f} GB a check may build whole); model.layerwise.sublayers checks "
                        "every layer against the oracle one layer at a time instead")


def serving_model(ctx: CheckContext, dtype: torch.dtype = torch.float32, mxfp4_mode: str = "cached") -> ServingModel:
    """ServingModel(serving_config(ctx), dtype) loaded with the checkpoint, cached per run (dtype, mxfp4 mode).
    Checks that need caches call `model.allocate_caches(...)` themselves (fresh, sized for the check).
    At real size only the served model (ctx.dtype) is built; any other is a skip naming the sizes."""
    if dtype != ctx.dtype:
        require_whole_model(ctx, "a serving model", dtype)
    key = f"serving.model.{str(dtype).removeprefix('torch.')}.{mxfp4_mode}"
    if ctx.level in ("model", "serving") and dtype in (torch.bfloat16, torch.float32):
        # a float64 serving model is an instrument (a gold), not a dtype anything is served in
        ctx.serving_dtypes.add(_dtype_name(dtype))
    if key not in ctx.cache:
        cfg = serving_config(ctx)
        if ctx.device.type == "cuda":  # say it before the allocator does
            require_fit(f"a serving model in {_dtype_name(dtype)}", whole_model_bytes(cfg, dtype),
                        device_memory_gib(ctx.device), "a card with more memory, or --dtype bfloat16")
        ctx.cache[key] = ServingModel(cfg, dtype, ctx.device, mxfp4_mode).load(checkpoint_tensors(ctx))
    model: ServingModel = ctx.cache[key]
    model.attn_res_storage = "prealloc"
    model.mla_absorb = True
    return model


def served_model(ctx: CheckContext, mxfp4_mode: str = "cached") -> ServingModel:
    """The serving model in the run's serving dtype (`parity --dtype`): what `serve --dtype` will run."""
    return serving_model(ctx, ctx.dtype, mxfp4_mode)


def reference_model(ctx: CheckContext, dtype: torch.dtype = torch.float32) -> K3Reference:
    """K3Reference(ctx.cfg, dtype) with the checkpoint loaded strictly, on ctx.device, cached per dtype."""
    require_whole_model(ctx, "the whole-model oracle", dtype)

    def build() -> K3Reference:
        ref = K3Reference(ctx.cfg, dtype)
        load_into(ref, ctx.cfg, checkpoint_tensors(ctx))
        tag_model(ref, ctx.target)  # a GGUF's weight types, for its arithmetic (peers/gguf_target.py)
        return ref.to(ctx.device)
    return _cached(ctx, f"oracle.k3.{_dtype_name(dtype)}", build)


def hf_model(ctx: CheckContext, dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers' KimiLinearForCausalLM with the same weights (Kimi-Linear configs only)."""
    require_whole_model(ctx, "transformers' model", dtype)

    def build() -> nn.Module:
        return build_hf_model(ctx.cfg, ctx.target.hf_config(), checkpoint_tensors(ctx), dtype=dtype,
                              device=ctx.device)
    return _cached(ctx, f"oracle.hf.{_dtype_name(dtype)}", build)


def layers(model: ServingModel | K3Reference) -> list[Any]:
    """The decoder layers of either stack, untyped: which sub-modules a layer has depends on its kind."""
    return list(model.model.layers)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def prompt(ctx: CheckContext, length: int, salt: int = 0) -> torch.Tensor:
    """Token ids [length] that depend only on (run seed, length, salt): checks share oracle runs."""
    g = torch.Generator().manual_seed(ctx.seed * 1_000_003 + length * 7919 + salt)
    return torch.randint(0, ctx.cfg.vocab_size, (length,), generator=g)


def reference_forward(ctx: CheckContext, ids: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> tuple[Any, RouteRecord]:
    """The oracle's forward (with captures) on `ids` and its router decisions, cached per run."""
    key = f"serving.oracle_run.{str(dtype).removeprefix('torch.')}.{hash(tuple(ids.tolist()))}"
    if key not in ctx.cache:
        ref = reference_model(ctx, dtype)
        with record_routes(ref) as routes:
            out = ref(ids.to(ctx.device), capture=True)
        ctx.cache[key] = (out, routes)
    return ctx.cache[key]


def reference_gold(ctx: CheckContext, ids: torch.Tensor) -> Any:
    """The oracle in fp64 on `ids` (with captures), its routing pinned to the fp32 oracle's choices where a
    flip is a near-tie explained by drift: the same pinning the model checks apply to the candidate, so the
    fp32-vs-fp64 noise of a whole model is not dominated by one token's expert flip. Cached per run."""
    key = f"serving.oracle_gold.{hash(tuple(ids.tolist()))}"
    if key not in ctx.cache:
        _, routes = reference_forward(ctx, ids)
        gold_model, stats = reference_model(ctx, torch.float64), PinStats()
        with pin_routes(gold_model, routes, reference_model(ctx), ctx.cfg, stats):
            ctx.cache[key] = gold_model(ids.to(ctx.device), capture=True)
        ctx.cache[key + ".pins"] = stats
    return ctx.cache[key]


def single_pass(ids: torch.Tensor, device: torch.device) -> ForwardContext:
    """A cacheless context for one sequence (module checks)."""
    return ForwardContext(PackedBatch.build(ids, [ids.numel()], device=device))


def packed_pass(lens: list[int], device: torch.device) -> ForwardContext:
    return ForwardContext(PackedBatch.build(torch.zeros(sum(lens), dtype=torch.long), lens, device=device))


def dummy_ids(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.long)


def require_fast_path(what: str, reason: str | None) -> None:
    """Skip (with the reason printed) a CUDA check whose fast path cannot run here."""
    if reason is not None:
        raise SkipCheck(f"the {what} is not available here: {reason}")


def assert_routed(*ops: str, backend: str) -> None:
    """A fast-path check compares nothing unless the registry really ran that path: refuse otherwise."""
    ran = {op: REGISTRY.last_backend.get(op) for op in ops}
    if any(b != backend for b in ran.values()):
        raise RuntimeError(f"registry ran {ran}, not {backend}; last fallbacks {REGISTRY.fallbacks[-len(ops):]}")


@contextlib.contextmanager
def torch_path(*ops: str) -> Iterator[None]:
    """Pin `ops` to their torch reference (usable as a decorator): module checks compare the modules' math
    bit for bit, which a CUDA fast path matches only to rounding (its own kernel.* check holds it to that)."""
    for op in ops:
        REGISTRY.force(op, TORCH)
    try:
        yield
    finally:
        for op in ops:
            REGISTRY.force(op, None)


def layer_inputs(ctx: CheckContext, n_tokens: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Random hidden states [T, H] from the check's generator, on ctx.device."""
    x = torch.randn(n_tokens, ctx.cfg.hidden_size, generator=ctx.generator) * scale
    return x.to(dtype).to(ctx.device)


@contextlib.contextmanager
def stale_kda_state(pool: Any) -> Iterator[None]:
    """Control fault: KDA recurrent states are never written back to `pool` (prefill's stores are
    dropped; decode updates its states in place, so it is handed a throwaway copy instead)."""
    def throwaway(layer: int) -> torch.Tensor:
        return pool.state[pool.layer_index[layer]].clone()

    with patched(pool, "store_state", lambda *a, **k: None), patched(pool, "state_view", throwaway):
        yield
