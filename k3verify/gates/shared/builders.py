"""Cached models and small helpers for the parity checks (gates/checks/) and what reuses their trials.

Weights come from one place, `checkpoint_tensors(ctx)` (the target's checkpoint, read lazily), so the oracle,
transformers' model and the serving model load the very same tensors. Everything is cached per run in ctx.cache.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from k3verify.checkpoint.loader import load_into
from k3verify.config import ModelConfig
from k3verify.gates.core.check import CheckContext, SkipCheck
from k3verify.gates.core.evidence import SIZE_SKIP
from k3verify.gates.shared import card_room
from k3verify.gates.shared.card_room import largest_layer_bytes, parameter_counts
from k3verify.gates.shared.patch import patched
from k3verify.gates.shared.route_pin import PinStats, RouteRecord, pin_routes, record_routes
from k3verify.kernels.registry import REGISTRY, TORCH
from k3verify.oracle.hf_kimi_linear import build_hf_model
from k3verify.oracle.k3_reference import K3Reference
from k3verify.oracle.streamed import StreamedReference
from k3verify.peers.gguf_target import tag_model
from k3verify.plan.device_fit import device_memory_gib, env_gib, require_fit
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
# its served model whole; the oracle runs one decoder layer at a time (oracle/streamed.py) and a check that needs
# another whole model runs on a slice (gates/shared/slice.py). K3V_WHOLE_MODEL_GIB overrides it (recorded in the
# report with every K3V_ variable): tests set it low so the tiny presets take the streamed and sliced paths.
WHOLE_MODEL_BYTES = 16 << 30
WHOLE_MODEL_ENV = "K3V_WHOLE_MODEL_GIB"


def whole_model_limit() -> int:
    """Bytes a check may build whole: $K3V_WHOLE_MODEL_GIB when set, else WHOLE_MODEL_BYTES."""
    gib = env_gib(WHOLE_MODEL_ENV, zero_ok=True)
    if gib is None:
        return WHOLE_MODEL_BYTES
    return int(gib * 2**30)


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the text model, MXFP4 experts counted dense (two values per packed byte)."""
    outside, layers = parameter_counts(cfg)
    return outside + sum(layers)


def whole_model_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return parameter_count(cfg) * torch.empty((), dtype=dtype).element_size()


def fits_whole(ctx: CheckContext, dtype: torch.dtype) -> bool:
    """Whether a whole model of ctx.cfg in `dtype` may be built for a check (whole_model_limit)."""
    return whole_model_bytes(ctx.cfg, dtype) <= whole_model_limit()


def require_whole_model(ctx: CheckContext, what: str, dtype: torch.dtype) -> None:
    """Skip (with the sizes printed) a check that would build `what` whole in `dtype` at real size; the suite
    then runs the check again on a slice of the model (gates/shared/slice.py) where it can."""
    need, limit = whole_model_bytes(ctx.cfg, dtype), whole_model_limit()
    if need > limit:
        raise SkipCheck(f"{SIZE_SKIP} {what} in {_dtype_name(dtype)} would hold {need / 1e9:.3g} GB (more than the "
                        f"{limit / 1e9:.3g} GB a check may build whole)")


def _serving_key(dtype: torch.dtype, mxfp4_mode: str) -> str:
    return f"serving.model.{_dtype_name(dtype)}.{mxfp4_mode}"


def make_room(ctx: CheckContext, need_bytes: int, what: str) -> None:
    """card_room.make_room, the run's served model (ctx.dtype) kept to the last."""
    card_room.make_room(ctx, need_bytes, what, last=_serving_key(ctx.dtype, "cached"))


def serving_model(ctx: CheckContext, dtype: torch.dtype = torch.float32, mxfp4_mode: str = "cached") -> ServingModel:
    """ServingModel(serving_config(ctx), dtype) loaded with the checkpoint, cached per run (dtype, mxfp4 mode).
    Checks that need caches call `model.allocate_caches(...)` themselves (fresh, sized for the check).
    At real size only the served model (ctx.dtype) is built; any other is a skip naming the sizes."""
    if dtype != ctx.dtype:
        require_whole_model(ctx, "a serving model", dtype)
    key = _serving_key(dtype, mxfp4_mode)
    if ctx.level in ("model", "serving") and dtype in (torch.bfloat16, torch.float32):
        # a float64 serving model is an instrument (a gold), not a dtype anything is served in
        ctx.serving_dtypes.add(_dtype_name(dtype))
    if key not in ctx.cache:
        cfg = serving_config(ctx)
        if ctx.device.type == "cuda":  # say it before the allocator does
            require_fit(f"a serving model in {_dtype_name(dtype)}", whole_model_bytes(cfg, dtype),
                        device_memory_gib(ctx.device), "a card with more memory, or --dtype bfloat16")
            make_room(ctx, whole_model_bytes(cfg, dtype), f"a serving model in {_dtype_name(dtype)}")
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
        make_room(ctx, whole_model_bytes(ctx.cfg, dtype), f"the whole-model oracle in {_dtype_name(dtype)}")
        ref = K3Reference(ctx.cfg, dtype)
        load_into(ref, ctx.cfg, checkpoint_tensors(ctx))
        tag_model(ref, ctx.target)  # a GGUF's weight types, for its arithmetic (peers/gguf_target.py)
        return ref.to(ctx.device)
    return _cached(ctx, f"oracle.k3.{_dtype_name(dtype)}", build)


def hf_model(ctx: CheckContext, dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers' KimiLinearForCausalLM with the same weights (Kimi-Linear configs only)."""
    require_whole_model(ctx, "transformers' model", dtype)

    def build() -> nn.Module:
        make_room(ctx, whole_model_bytes(ctx.cfg, dtype), f"transformers' model in {_dtype_name(dtype)}")
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


STREAMED_NOTE = "oracle/streamed.py"  # a result whose oracle ran streamed carries a note naming it
STREAMED_ORDER = "oracle.streamed.layer_order"  # cache key: a layer order for the streamed oracle (a test's fault)


def oracle_runner(ctx: CheckContext, dtype: torch.dtype = torch.float32) -> K3Reference | StreamedReference:
    """The oracle in `dtype` as a callable ids [T] -> ReferenceOutput: the whole K3Reference where it may be built
    (reference_model), else the streamed reference over the same checkpoint (one decoder layer at a time,
    bit-identical where both fit). A check that used the streamed one says so (streamed_notes)."""
    if fits_whole(ctx, dtype):
        return reference_model(ctx, dtype)
    note_streamed(ctx, dtype)

    def build() -> StreamedReference:
        make_room(ctx, largest_layer_bytes(ctx.cfg, dtype), f"the streamed oracle in {_dtype_name(dtype)}")
        order = ctx.cache.get(STREAMED_ORDER)
        return StreamedReference(ctx.cfg, checkpoint_tensors(ctx), dtype, ctx.device,
                                 **({} if order is None else {"layer_order": order}))
    streamed: StreamedReference = _cached(ctx, f"oracle.k3.streamed.{_dtype_name(dtype)}", build)
    return streamed


def oracle_modules(runner: K3Reference | StreamedReference) -> nn.Module:
    """The module tree whose routers record_routes / pin_routes hook (the streamed one's meta-built reference)."""
    return runner.ref if isinstance(runner, StreamedReference) else runner


def pin_reference(ctx: CheckContext) -> nn.Module:
    """The fp32 oracle's routers, what pin_routes measures drift against: the whole reference where it fits, else
    a meta-built K3Reference with only its MoE routers materialised (a few MB at real size)."""
    if fits_whole(ctx, torch.float32):
        return reference_model(ctx)

    def build() -> K3Reference:
        with torch.device("meta"):
            ref = K3Reference(ctx.cfg, torch.float32)
        for i, layer in enumerate(ref.model.layers):
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None:
                moe.gate.to_empty(device=ctx.device)
                load_into(ref, ctx.cfg, checkpoint_tensors(ctx), f"model.layers.{i}.block_sparse_moe.gate.")
        return ref
    return _cached(ctx, "oracle.k3.routers", build)


class StreamedLayers:
    """The decoder layers of a meta-built K3Reference in one dtype, each materialised from the checkpoint when
    indexed and the one indexed before it dropped: one layer's weights at a time, the same modules and values as
    the whole reference's layers."""

    def __init__(self, ctx: CheckContext, dtype: torch.dtype) -> None:
        with torch.device("meta"):
            self.ref = K3Reference(ctx.cfg, dtype)
        self.cfg, self.tensors, self.device = ctx.cfg, checkpoint_tensors(ctx), ctx.device
        self.loaded: int | None = None

    def __getitem__(self, i: int) -> Any:  # a decoder layer: which sub-modules it has depends on its kind
        layer: nn.Module = self.ref.model.layers[i]
        if self.loaded != i:
            if self.loaded is not None:
                self.ref.model.layers[self.loaded].to(device="meta")
            layer.to_empty(device=self.device)
            load_into(self.ref, self.cfg, self.tensors, f"model.layers.{i}.")
            self.loaded = i
        return layer


def reference_layers(ctx: CheckContext, dtype: torch.dtype = torch.float32) -> list[Any] | StreamedLayers:
    """The oracle's decoder layers in `dtype` (index them): the whole reference's where it may be built, else
    materialised one at a time (StreamedLayers), which the check's result then says."""
    if fits_whole(ctx, dtype):
        return layers(reference_model(ctx, dtype))
    note = (f"the {_dtype_name(dtype)} oracle's layers were built one at a time from the checkpoint: the whole "
            f"model in {_dtype_name(dtype)} would hold {whole_model_bytes(ctx.cfg, dtype) / 1e9:.3g} GB")
    if note not in ctx.run_notes:
        ctx.run_notes.append(note)
    def build() -> StreamedLayers:
        make_room(ctx, largest_layer_bytes(ctx.cfg, dtype), f"the oracle's layers in {_dtype_name(dtype)}")
        return StreamedLayers(ctx, dtype)
    streamed: StreamedLayers = _cached(ctx, f"oracle.k3.layers.{_dtype_name(dtype)}", build)
    return streamed


def reference_tail(ctx: CheckContext, dtype: torch.dtype = torch.float32) -> K3Reference:
    """The oracle in `dtype` for what follows the decoder layers (final norm, the output mix of Block Attention
    Residuals): the whole reference where it may be built, else a meta-built one with only those materialised."""
    if fits_whole(ctx, dtype):
        return reference_model(ctx, dtype)

    def build() -> K3Reference:
        with torch.device("meta"):
            ref = K3Reference(ctx.cfg, dtype)
        for name, module in ref.model.named_children():
            if name not in ("embed_tokens", "layers"):
                module.to_empty(device=ctx.device)
        load_into(ref, ctx.cfg, checkpoint_tensors(ctx), "model.norm.")
        if ctx.cfg.uses_attn_res:
            load_into(ref, ctx.cfg, checkpoint_tensors(ctx), "model.output_attn_res_")
        return ref
    return _cached(ctx, f"oracle.k3.tail.{_dtype_name(dtype)}", build)


def note_streamed(ctx: CheckContext, dtype: torch.dtype) -> None:
    """Say in the running check's result that its oracle in `dtype` ran streamed (no-op where it runs whole)."""
    if fits_whole(ctx, dtype):
        return
    note = (f"the {_dtype_name(dtype)} oracle ran streamed, one decoder layer at a time ({STREAMED_NOTE}): whole it "
            f"would hold {whole_model_bytes(ctx.cfg, dtype) / 1e9:.3g} GB, over the {whole_model_limit() / 1e9:.3g} GB "
            "a check may build whole")
    if note not in ctx.run_notes:
        ctx.run_notes.append(note)


def reference_forward(ctx: CheckContext, ids: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> tuple[Any, RouteRecord]:
    """The oracle's forward (with captures) on `ids` and its router decisions, cached per run; streamed where the
    whole oracle may not be built (oracle_runner)."""
    key = f"serving.oracle_run.{str(dtype).removeprefix('torch.')}.{hash(tuple(ids.tolist()))}"
    note_streamed(ctx, dtype)
    if key not in ctx.cache:
        ref = oracle_runner(ctx, dtype)
        with record_routes(oracle_modules(ref)) as routes:
            out = ref(ids.to(ctx.device), capture=True)
        ctx.cache[key] = (out, routes)
    return ctx.cache[key]


def reference_gold(ctx: CheckContext, ids: torch.Tensor) -> Any:
    """The oracle in fp64 on `ids` (with captures), its routing pinned to the fp32 oracle's choices where a
    flip is a near-tie explained by drift: the same pinning the model checks apply to the candidate, so the
    fp32-vs-fp64 noise of a whole model is not dominated by one token's expert flip. Cached per run; streamed
    where the whole fp64 oracle may not be built."""
    key = f"serving.oracle_gold.{hash(tuple(ids.tolist()))}"
    note_streamed(ctx, torch.float64)
    if key not in ctx.cache:
        _, routes = reference_forward(ctx, ids)
        gold_model, stats = oracle_runner(ctx, torch.float64), PinStats()
        with pin_routes(oracle_modules(gold_model), routes, pin_reference(ctx), ctx.cfg, stats):
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
