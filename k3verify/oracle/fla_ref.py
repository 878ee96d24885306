"""Guarded calls into flash-linear-attention's KDA references and kernels.

fla is imported lazily (it imports triton at import time and warns on CPU); the two naive KDA
functions are loaded straight from the pinned fla/ops/kda/naive.py without importing the package
at all (it needs only torch and einops). Before every call the
target's signature is probed for each parameter we pass: an older fla swallows unknown keywords
through **kwargs and silently computes something else, so a missing name raises OracleMismatch.
The one exception is fla 0.6.0's `chunk_kda`, which reads `A_log` / `dt_bias` out of **kwargs by
design; those two are passed only after a behavioural probe (changing them must change the output).

Shapes follow fla: q, k [B, T, h, dk]; v [B, T, h, dv]; g [B, T, h, dk]; beta [B, T, h].
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

# chunk_kda (fla 0.6.0) consumes these from **kwargs (`kwargs.get("A_log")`); see _probe_kwargs_engaged.
_CHUNK_KWARGS_CONSUMED = frozenset({"A_log", "dt_bias"})


class OracleMismatch(RuntimeError):
    """The installed oracle does not offer what we call (a parameter, a module, a device)."""


def _fla_function(module: str, name: str) -> Callable[..., Any]:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise OracleMismatch(f"cannot import {module} (flash-linear-attention 0.6.0 is pinned): {exc}") from exc
    fn = getattr(mod, name, None)
    if fn is None:
        raise OracleMismatch(f"{module} has no {name}: the installed fla is not the pinned one")
    return fn


@functools.cache
def _naive_module() -> ModuleType:
    """fla/ops/kda/naive.py, the pinned file itself. It needs only torch and einops, so unless fla is
    already imported it is loaded on its own: importing the fla package costs seconds of CPU (triton,
    its layers) that a CPU reference never uses."""
    if "fla.ops.kda.naive" in sys.modules:
        return sys.modules["fla.ops.kda.naive"]
    spec = importlib.util.find_spec("fla")  # locates the package without executing fla/__init__
    if spec is None or not spec.submodule_search_locations:
        raise OracleMismatch("flash-linear-attention is not installed (fla-core 0.6.0 is pinned)")
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    file_spec = importlib.util.spec_from_file_location("_k3verify_fla_kda_naive", path)
    if file_spec is None or file_spec.loader is None or not path.is_file():
        raise OracleMismatch(f"fla's KDA reference file is missing: {path}")
    module = importlib.util.module_from_spec(file_spec)
    try:
        file_spec.loader.exec_module(module)
    except ImportError:  # a newer naive.py with package-relative imports: take the normal route
        return importlib.import_module("fla.ops.kda.naive")
    return module


def _naive_function(name: str) -> Callable[..., Any]:
    fn = getattr(_naive_module(), name, None)
    if fn is None:
        raise OracleMismatch(f"fla/ops/kda/naive.py has no {name}: the installed fla is not the pinned one")
    return fn


def named_parameters(fn: Callable[..., Any]) -> frozenset[str]:
    """Parameters `fn` names explicitly (its *args / **kwargs catch-alls excluded)."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return frozenset(n for n, p in inspect.signature(fn).parameters.items() if p.kind not in variadic)


def probe(fn: Callable[..., Any], params: Iterable[str], allowed_via_kwargs: frozenset[str] = frozenset()) -> None:
    """Raise OracleMismatch naming the first parameter in `params` that `fn` does not declare."""
    named = named_parameters(fn)
    for name in params:
        if name not in named and name not in allowed_via_kwargs:
            raise OracleMismatch(f"{fn.__module__}.{fn.__qualname__} has no parameter {name!r}; refusing to pass it "
                                 f"(a **kwargs catch-all would swallow it and compute something else)")


def _call(fn: Callable[..., Any], kwargs: dict[str, Any], allowed_via_kwargs: frozenset[str] = frozenset()) -> Any:
    probe(fn, kwargs, allowed_via_kwargs)
    return fn(**kwargs)


def naive_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    scale: float | None = None, initial_state: torch.Tensor | None = None,
                    output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's `naive_recurrent_kda` (pure torch, fp32 inside; o in v's dtype, state [B, h, dk, dv])."""
    fn = _naive_function("naive_recurrent_kda")
    return _call(fn, dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state))


def naive_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                scale: float | None = None, chunk_size: int = 64) -> torch.Tensor:
    """fla's `naive_chunk_kda` for any T: pads the tail to a chunk multiple and cuts it off again.

    The pad is q=k=v=0, g=0 (decay 1), β=0: a padded token never writes the state, and as the pad
    sits after every real token, causality keeps it out of every real output."""
    fn = _naive_function("naive_chunk_kda")
    T = q.shape[1]
    pad = (-T) % chunk_size

    def tail(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x

    o, _ = _call(fn, dict(q=tail(q), k=tail(k), v=tail(v), g=tail(g), beta=tail(beta), scale=scale,
                          chunk_size=chunk_size))
    return o[:, :T]


def naive_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """fla's `naive_kda_gate`: −exp(A_log) · softplus(g + dt_bias); g [..., h, dk] -> fp32."""
    fn = _fla_function("fla.ops.kda.gate", "naive_kda_gate")
    return _call(fn, dict(g=g, A_log=A_log, dt_bias=dt_bias, output_dtype=torch.float32))


def naive_lowerbound_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                          lower_bound: float) -> torch.Tensor:
    """fla's `naive_kda_lowerbound_gate`: L · sigmoid(exp(A_log) · (g + dt_bias)) -> fp32."""
    fn = _fla_function("fla.ops.kda.gate", "naive_kda_lowerbound_gate")
    return _call(fn, dict(g=g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, output_dtype=torch.float32))


def _require_cuda(*tensors: torch.Tensor) -> None:
    if not all(t.is_cuda for t in tensors):
        raise OracleMismatch("fla's Triton KDA kernels need CUDA tensors; use naive_recurrent / naive_chunk on CPU")


def _kernel_kwargs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   opts: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(q=q, k=k, v=v, g=g, beta=beta)
    kwargs.update({name: value for name, value in opts.items() if value is not None})
    return kwargs


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
              scale: float | None = None, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
              use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False, safe_gate: bool = False,
              lower_bound: float | None = None, use_qk_l2norm_in_kernel: bool = False,
              cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's Triton `chunk_kda` (CUDA only), every parameter checked before it is passed."""
    _require_cuda(q, k, v, g, beta)
    fn = _fla_function("fla.ops.kda", "chunk_kda")
    kwargs = _kernel_kwargs(q, k, v, g, beta, dict(
        scale=scale, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, safe_gate=safe_gate, lower_bound=lower_bound,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, initial_state=initial_state,
        output_final_state=output_final_state))
    via_kwargs = _CHUNK_KWARGS_CONSUMED & (set(kwargs) - named_parameters(fn))
    for name in sorted(via_kwargs):
        _probe_kwargs_engaged(fn, name, q.device.index or 0)
    return _call(fn, kwargs, allowed_via_kwargs=frozenset(via_kwargs))


def fused_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                        scale: float | None = None, A_log: torch.Tensor | None = None,
                        dt_bias: torch.Tensor | None = None, use_gate_in_kernel: bool = False,
                        use_beta_sigmoid_in_kernel: bool = False, safe_gate: bool = False,
                        lower_bound: float | None = None, use_qk_l2norm_in_kernel: bool = False,
                        cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                        output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's Triton `fused_recurrent_kda` (CUDA only).

    fla 0.6.0's fused_recurrent has no `safe_gate` switch: its in-kernel gate becomes the safe
    formula whenever `lower_bound` is set, so safe_gate=True requires lower_bound and is not passed."""
    _require_cuda(q, k, v, g, beta)
    fn = _fla_function("fla.ops.kda", "fused_recurrent_kda")
    if safe_gate and lower_bound is None:
        raise ValueError("safe_gate=True needs lower_bound (the safe gate is L·sigmoid(exp(A_log)·g))")
    if safe_gate and "safe_gate" in named_parameters(fn):
        raise OracleMismatch("fused_recurrent_kda now declares safe_gate: re-read its semantics before passing it")
    kwargs = _kernel_kwargs(q, k, v, g, beta, dict(
        scale=scale, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, initial_state=initial_state,
        output_final_state=output_final_state))
    return _call(fn, kwargs)


@functools.cache
def _probe_kwargs_engaged(fn: Callable[..., Any], name: str, device_index: int) -> None:
    """Prove that `fn` really reads keyword `name` from **kwargs: perturbing it must change the output."""
    dev = torch.device("cuda", device_index)
    gen = torch.Generator(device="cpu").manual_seed(0)
    T, h, d = 64, 2, 64

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev)

    q, k, v = (F.normalize(rnd(1, T, h, d), dim=-1) for _ in range(3))
    base: dict[str, Any] = dict(q=q, k=k, v=v, g=rnd(1, T, h, d), beta=torch.rand(1, T, h, generator=gen).to(dev),
                                A_log=torch.zeros(h, device=dev), dt_bias=torch.zeros(h * d, device=dev),
                                use_gate_in_kernel=True)
    out0, _ = fn(**base)
    moved = dict(base)
    moved[name] = base[name] + 1.0
    out1, _ = fn(**moved)
    if torch.equal(out0, out1):
        raise OracleMismatch(f"{fn.__module__}.{fn.__qualname__} ignores {name!r} passed through **kwargs "
                             f"(output unchanged when it changes)")
