"""fla's Triton KDA kernels behind the same contract as torch_ref (CUDA only).

Prefill (and the post-gate decode op) get raw q/k (normalized in-kernel), the finished log decay g (fp32)
and the post-sigmoid beta, so the kernels' own gate and beta-sigmoid stages stay off. The serving decode
(`kda_decode_slots_gated_fla`) hands over the gate's and beta's raw inputs instead and turns both stages on:
beta is still squashed exactly once, either in the layer (torch_ref.kda_beta) or in the kernel, never both.
fla is probed by signature, not version: an older fla silently swallows unknown keyword arguments via
**kwargs and computes something else.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from k3verify.kernels.pinned import host_tensor
from k3verify.kernels.registry import REGISTRY
from k3verify.kernels.varlen import DeviceSeqlens, Offsets

_PREFILL_PARAMS = ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                   "use_beta_sigmoid_in_kernel", "safe_gate", "lower_bound", "cu_seqlens", "cu_seqlens_cpu")
_GRAPH_PARAMS = ("use_graph", "max_num_seqs")
MAX_HEAD_DIM = 256  # fla's KDA kernels assert K <= 256
_DTYPES = (torch.bfloat16, torch.float16)


_SLOTS_PARAMS = ("scale", "initial_state", "inplace_final_state", "ssm_state_indices", "use_qk_l2norm_in_kernel",
                 "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "A_log", "dt_bias", "lower_bound")


@functools.cache
def _fla_ops() -> tuple[Any, Any] | str:
    try:
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as exc:  # ImportError, or triton failing to initialise
        return f"fla KDA kernels unavailable: {type(exc).__name__}: {exc}"
    for fn, needed in ((chunk_kda, _PREFILL_PARAMS), (fused_recurrent_kda_fwd, _SLOTS_PARAMS)):
        missing = _missing_params(fn, needed)
        if missing:
            return f"fla {fn.__name__} lacks parameters {missing} (signature probe); refusing to call it"
    return chunk_kda, fused_recurrent_kda_fwd


def _missing_params(fn: Any, needed: tuple[str, ...]) -> list[str]:
    """The keyword parameters of `needed` that fn's signature lacks (an older fla swallows unknown ones)."""
    params = inspect.signature(fn).parameters
    return [p for p in needed if p not in params]


def _loaded_ops() -> tuple[Any, Any]:
    """(chunk_kda, fused_recurrent_kda_fwd); only called after `available()` said yes."""
    ops = _fla_ops()
    if isinstance(ops, str):
        raise RuntimeError(ops)
    return ops


def available() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available"
    ops = _fla_ops()
    return ops if isinstance(ops, str) else None


def _shape_reason(q: torch.Tensor, v: torch.Tensor, state: torch.Tensor) -> str | None:
    if q.dtype == torch.float32:
        return ("fp32 activations: fla's Triton KDA forms its products in TF32, so the exact fp32 path is the "
                "torch reference")
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"head dims dk={q.shape[-1]}, dv={v.shape[-1]} exceed fla's limit {MAX_HEAD_DIM}"
    if q.dtype not in _DTYPES:
        return f"activation dtype {q.dtype} is not one of {_DTYPES}"
    if state.dtype != torch.float32:
        return f"state dtype {state.dtype} is not float32 (fla keeps the recurrent state in fp32)"
    if not q.is_cuda:
        return f"tensors are on {q.device}, not CUDA"
    return None


def accepts_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    cu_seqlens: Offsets, initial_state: torch.Tensor, scale: float,
                    lower_bound: float | None = None) -> str | None:
    if lower_bound is not None and not (-5.0 <= lower_bound < 0.0):
        return f"lower_bound {lower_bound} is outside fla's safe-gate range [-5, 0)"
    if isinstance(cu_seqlens, DeviceSeqlens):
        reason = _graph_mode_reason()
        if reason is not None:
            return reason
        if cu_seqlens.num_tokens != q.shape[0] or initial_state.shape[0] != cu_seqlens.num_seqs:
            return (f"a static pack of {cu_seqlens.num_tokens} tokens / {cu_seqlens.num_seqs} sequences got "
                    f"{q.shape[0]} tokens and {initial_state.shape[0]} initial states")
    return _shape_reason(q, v, initial_state)


@functools.cache
def _graph_mode_reason() -> str | None:
    """Why fla's chunk_kda cannot take a static pack's device offsets (its `use_graph` varlen mode: the chunk list
    built on the device, empty trailing sequences allowed), or None."""
    ops = _fla_ops()
    if isinstance(ops, str):
        return ops
    missing = _missing_params(ops[0], _GRAPH_PARAMS)
    return f"fla chunk_kda lacks parameters {missing} (signature probe): no graph-capturable varlen mode" \
        if missing else None



def kda_prefill_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    cu_seqlens: Offsets, initial_state: torch.Tensor, scale: float,
                    lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    chunk_kda, _ = _loaded_ops()
    dt = q.dtype
    o, final = chunk_kda(
        q=q[None], k=k[None].to(dt), v=v[None].to(dt), g=g[None].float(), beta=beta[None].float(), scale=scale,
        initial_state=initial_state.contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
        safe_gate=lower_bound is not None, lower_bound=lower_bound, **_varlen(cu_seqlens, q.device),
    )
    return o[0].to(v.dtype), final


_last_varlen: list[tuple[tuple[int, ...], torch.device, dict[str, torch.Tensor]]] = []


def _varlen(cu_seqlens: Offsets, device: torch.device) -> dict[str, Any]:
    """chunk_kda's varlen arguments for a pack, without a host sync: none for one sequence (the dense [1, T]
    call), else the offsets on the device (an asynchronous copy) and on the host (`cu_seqlens_cpu`: fla derives
    its chunk indices there instead of reading the device tensor back). The same tensors are handed to every
    KDA layer of a pass, so fla's tensor_cache (keyed on argument identity) prepares the indices once, not
    once per layer. A static pack's offsets stay on the device: fla's `use_graph` mode builds a fixed-shape chunk
    list there (recorded into a captured graph, so a replay over other lengths rebuilds it)."""
    if isinstance(cu_seqlens, DeviceSeqlens):
        return {"cu_seqlens": cu_seqlens.cu, "use_graph": True, "max_num_seqs": cu_seqlens.num_seqs}
    if len(cu_seqlens) == 2:
        return {}
    key = tuple(cu_seqlens)
    if _last_varlen and _last_varlen[0][0] == key and _last_varlen[0][1] == device:
        return _last_varlen[0][2]
    cpu = host_tensor(key, device)
    args = {"cu_seqlens": cpu.to(device, non_blocking=True), "cu_seqlens_cpu": cpu}
    _last_varlen[:] = [(key, device, args)]
    return args



def accepts_decode_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         pool_state: torch.Tensor, slots: torch.Tensor, scale: float) -> str | None:
    if not pool_state.is_contiguous():
        return "the pool's per-layer state view is not contiguous (the kernel indexes slots by a fixed stride)"
    return _shape_reason(q, v, pool_state)


DECODE_SLOTS = "kda.decode_slots"  # the registry's op names (kernels.kda registers them; it imports this module)
DECODE_SLOTS_GATED = "kda.decode_slots_gated"
DIRECT = "direct launch"  # the path's name in the registry's refusals and disabled paths

# fla's decode recurrence launched with 2 warps where fla's own wrapper launches 4 (value block 32 and 2 stages as
# fla's): faster at 16 and 64 rows, no slower at 1 (docs/results/ has the runs). One launch at every batch size: a row's
# bits must not depend on how many rows share its step (a value block of 16 with one warp was faster at 1 and 16 rows,
# slower at 64, and gives other bits). Only the launch differs: the kernel, its arguments and its math are fla's (its
# outputs differ from fla's launch in the last bits: the reductions over dk split over other warps).
DECODE_LAUNCH = (32, 2, 2)  # (value block, warps, stages)
_RECURRENT_ARGS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "o", "h0", "ht", "cu_seqlens", "ssm_state_indices",
                   "num_accepted_tokens", "lower_bound", "scale", "N", "T", "H", "HV", "K", "V", "BK", "BV",
                   "stride_init_state_token", "stride_final_state_token", "stride_indices_seq", "stride_indices_tok",
                   "IS_BETA_HEADWISE", "USE_QK_L2NORM_IN_KERNEL", "INPLACE_FINAL_STATE", "USE_GATE_IN_KERNEL",
                   "APPLY_BETA_SIGMOID", "ALLOW_NEG_EIGVAL", "STATE_V_FIRST")


@functools.cache
def _recurrent_kernel() -> Any:
    """fla's fused_recurrent_kda_fwd_kernel, or why it cannot be launched directly (str): then fla's own wrapper
    launches it (registry.run_inside logs the reason once and counts it among the fallbacks)."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd_kernel as kernel
    except Exception as exc:
        return f"fla's fused_recurrent_kda_fwd_kernel is not importable ({type(exc).__name__}: {exc})"
    names = set(getattr(kernel, "arg_names", ()) or ())
    missing = [a for a in _RECURRENT_ARGS if a not in names]
    if missing:
        return f"fla's fused_recurrent_kda_fwd_kernel lacks arguments {missing} (signature probe)"
    return kernel


def _recurrent(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, slots: torch.Tensor, scale: float, *, gate_in_kernel: bool,
               beta_sigmoid_in_kernel: bool, a_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
               lower_bound: float | None = None, launch: tuple[int, int, int] = DECODE_LAUNCH) -> torch.Tensor:
    """One decode token per row [B, 1, ...] through fla's recurrence, state read and written in place by slot,
    q/k L2-normalised in the kernel; the forget gate from its raw input and beta's sigmoid in the kernel when
    asked. Returns o [B, 1, HV, V]. `op`: the registry op this call serves (its refusals are logged under it);
    `launch`: (value block, warps, stages) of the direct launch (a tuning sweep passes its own)."""
    kernel = _recurrent_kernel()

    def direct() -> torch.Tensor:
        B, T, H, K = k.shape
        HV, V = v.shape[2], v.shape[-1]
        bv, warps, stages = launch
        out = torch.empty_like(v)  # every element is stored: one program per (row, head, value block), T = 1
        kernel[(-(-V // bv) * B * HV,)](
            q=q, k=k, v=v, g=g, beta=beta, A_log=a_log, dt_bias=dt_bias, o=out, h0=state, ht=state, cu_seqlens=None,
            ssm_state_indices=slots, num_accepted_tokens=None, lower_bound=lower_bound, scale=scale, N=B, T=T, H=H,
            HV=HV, K=K, V=V, BK=1 << (K - 1).bit_length(), BV=bv, stride_init_state_token=state.stride(0),
            stride_final_state_token=state.stride(0), stride_indices_seq=slots.stride(0), stride_indices_tok=1,
            IS_BETA_HEADWISE=beta.ndim == v.ndim, USE_QK_L2NORM_IN_KERNEL=True, INPLACE_FINAL_STATE=True,
            USE_GATE_IN_KERNEL=gate_in_kernel, APPLY_BETA_SIGMOID=beta_sigmoid_in_kernel, ALLOW_NEG_EIGVAL=False,
            STATE_V_FIRST=False, num_warps=warps, num_stages=stages)
        return out

    out = REGISTRY.run_inside(op, DIRECT, kernel if isinstance(kernel, str) else None, direct,
                              "fla's own launch (4 warps)")
    if out is not None:
        return out
    _, fwd = _loaded_ops()
    o, _ = fwd(q=q, k=k, v=v, g=g, beta=beta, A_log=a_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
               initial_state=state, inplace_final_state=True, output_final_state=True, ssm_state_indices=slots,
               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate_in_kernel,
               use_beta_sigmoid_in_kernel=beta_sigmoid_in_kernel)
    return o


def kda_decode_slots_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         pool_state: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """fused_recurrent_kda's continuous-batching form: each row reads and writes its state in the pool
    by slot index, in place (no gather, no scatter, no copy of the state)."""
    dt = q.dtype
    o = _recurrent(DECODE_SLOTS, q[:, None].contiguous(), k[:, None].to(dt).contiguous(),
                   v[:, None].to(dt).contiguous(), g[:, None].float().contiguous(), beta[:, None].float().contiguous(),
                   pool_state, slots, scale, gate_in_kernel=False, beta_sigmoid_in_kernel=False)
    return o[:, 0].to(v.dtype)


def accepts_decode_slots_gated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f_raw: torch.Tensor,
                               dt_bias: torch.Tensor, a_log: torch.Tensor, b_logits: torch.Tensor,
                               pool_state: torch.Tensor, slots: torch.Tensor, scale: float,
                               lower_bound: float | None) -> str | None:
    B, h, dk = q.shape
    if f_raw.shape != (B, h * dk) or not f_raw.is_contiguous():
        return f"the gate input must be contiguous [{B}, {h * dk}]; got {tuple(f_raw.shape)}, stride {f_raw.stride()}"
    if dt_bias.shape != (h * dk,) or dt_bias.dtype != torch.float32 or not dt_bias.is_contiguous():
        return f"dt_bias must be contiguous fp32 [{h * dk}]; got {tuple(dt_bias.shape)} {dt_bias.dtype}"
    if a_log.shape != (h,) or a_log.dtype != torch.float32 or not a_log.is_contiguous():
        return f"A_log must be contiguous fp32 [{h}] (one entry per head); got {tuple(a_log.shape)} {a_log.dtype}"
    if b_logits.shape != (B, h):
        return f"b_logits must be [{B}, {h}]; got {tuple(b_logits.shape)}"
    return accepts_decode_slots(q, k, v, f_raw, b_logits, pool_state, slots, scale)


def kda_decode_slots_gated_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f_raw: torch.Tensor,
                               dt_bias: torch.Tensor, a_log: torch.Tensor, b_logits: torch.Tensor,
                               pool_state: torch.Tensor, slots: torch.Tensor, scale: float,
                               lower_bound: float | None) -> torch.Tensor:
    """kda_decode_slots_fla with the forget gate and beta's sigmoid computed inside the recurrence kernel
    (fla's use_gate_in_kernel / use_beta_sigmoid_in_kernel: the same math as torch_ref.kda_forget_gate / kda_beta, to
    rounding): six elementwise launches fewer per KDA layer and step (add, softplus, negation, multiply, cast,
    sigmoid; past one row a copy makes beta's logits contiguous). beta reaches the kernel as raw logits, squashed
    there once; nothing before it applies a sigmoid."""
    B, h, dk = q.shape
    o = _recurrent(DECODE_SLOTS_GATED, q[:, None].contiguous(), k[:, None].contiguous(), v[:, None].contiguous(),
                   f_raw.view(B, 1, h, dk), b_logits.contiguous()[:, None], pool_state, slots, scale,
                   gate_in_kernel=True, beta_sigmoid_in_kernel=True, a_log=a_log, dt_bias=dt_bias,
                   lower_bound=lower_bound)
    return o[:, 0].to(v.dtype)
