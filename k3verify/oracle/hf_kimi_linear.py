"""transformers' KimiLinearForCausalLM as an oracle, fed our checkpoint tensors.

Kimi-Linear only (transformers has no K3 features). Our names map to transformers' by the table in
`hf_state_dict`: the three depthwise convs fuse into one `conv1d` (q|k|v along dim 0), the gate
parameters move under `forget_gate`, routed experts stack into `gate_up_proj` [E, 2I, H] (w1 then
w3) and `down_proj` [E, H, I], and `block_sparse_moe` is called `mlp`. Every transformers tensor is
filled exactly once and every source tensor is used exactly once, or this raises.

On CPU transformers would route its KDA / conv helpers to fla's Triton kernels whenever fla
imports; `torch_kda_paths` patches the module globals back to transformers' own torch functions
and asserts that the routing took.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

import torch
from torch import nn

from k3verify.checkpoint import mxfp4
from k3verify.checkpoint.names import ignorable_reason, quantized_pair, to_module_name
from k3verify.config import ModelConfig

MODELING = "transformers.models.kimi_linear.modeling_kimi_linear"
# transformers wraps these with a decorator that prefers fla; the torch originals sit in __wrapped__.
KDA_FUNCTIONS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                 "causal_conv1d_update")


class HFMappingError(ValueError):
    """Our tensors and transformers' parameters do not pair up one to one."""


def modeling_module() -> ModuleType:
    return importlib.import_module(MODELING)


def torch_function(mod: ModuleType, name: str) -> Any:
    """The pure-torch original behind transformers' fla-preferring decorator."""
    fn = inspect.unwrap(getattr(mod, name))
    if fn.__module__ != mod.__name__ or fn.__code__.co_filename != mod.__file__:
        raise RuntimeError(f"{mod.__name__}.{name} unwraps to {fn.__module__}.{fn.__qualname__}, not the torch "
                           f"function defined in {mod.__file__}")
    return fn


@contextlib.contextmanager
def torch_kda_paths(device: torch.device) -> Iterator[dict[str, str]]:
    """Inside: the modeling module's KDA / conv helpers are transformers' torch functions (CPU).

    Yields a routing record {function name: qualified target}. On CUDA fla's kernels stay in place."""
    mod = modeling_module()
    saved = {name: getattr(mod, name) for name in KDA_FUNCTIONS}
    try:
        if device.type != "cuda":
            for name in KDA_FUNCTIONS:
                setattr(mod, name, torch_function(mod, name))
            for name in KDA_FUNCTIONS:  # the routing check: what forward() will resolve at call time
                if getattr(mod, name) is not torch_function(mod, name):
                    raise RuntimeError(f"routing failed: {MODELING}.{name} is not the torch function after patching")
        yield {name: _describe(getattr(mod, name)) for name in KDA_FUNCTIONS}
    finally:
        for name, fn in saved.items():
            setattr(mod, name, fn)


def kda_routing(device: torch.device) -> dict[str, str]:
    """Where each KDA / conv helper lands while a forward on `device` runs (see torch_kda_paths)."""
    with torch_kda_paths(device) as routing:
        return routing


def _describe(fn: Any) -> str:
    """Where a call of `fn` lands: the torch function itself, or what transformers' decorator chose."""
    if not hasattr(fn, "__wrapped__"):
        return f"{fn.__module__}.{fn.__qualname__} [torch]"
    impl = inspect.getclosurevars(fn).nonlocals.get("implementation")
    if impl is None:
        return f"{fn.__module__}.{fn.__qualname__} [decorated, target unknown]"
    kind = "torch" if getattr(impl, "__module__", "") == MODELING else "package"
    return f"{impl.__module__}.{impl.__qualname__} [{kind}]"


def dense_module_tensors(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> our module names, MXFP4 pairs dequantized to dense fp32 `wN.weight`."""
    out: dict[str, torch.Tensor] = {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if ignorable_reason(name) is not None:
            continue
        mod_name = to_module_name(cfg, name)
        pair = quantized_pair(mod_name) if mod_name else None
        if pair is not None:
            pairs.setdefault(pair[0], {})[pair[1]] = value
        elif mod_name is not None:
            out[mod_name] = value
    group = cfg.quant.group_size if cfg.quant is not None else mxfp4.GROUP
    for dense, parts in pairs.items():
        out[dense] = mxfp4.dequantize(parts["weight_packed"], parts["weight_scale"], torch.float32, group)
    return out


def hf_state_dict(cfg: ModelConfig, ours: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our module-named tensors -> transformers KimiLinearForCausalLM names, each source used once."""
    if cfg.is_k3:
        raise HFMappingError("transformers' KimiLinear has no K3 features (attn-res, latent MoE, SiTU, safe gate)")
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in ours:
            raise HFMappingError(f"our tensors lack {name!r}")
        if name in used:
            raise HFMappingError(f"{name!r} would be used twice")
        used.add(name)
        return ours[name]

    sd: dict[str, torch.Tensor] = {}
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        sd[name] = take(name)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            sd[p + n] = take(p + n)
        a = p + "self_attn."
        if cfg.layer_kind(i) == "kda":
            sd[a + "conv1d.weight"] = torch.cat([take(f"{a}{x}_conv1d.weight") for x in "qkv"], dim=0)
            for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
                sd[a + "forget_gate." + n] = take(a + n)
            for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj"):
                sd[f"{a}{n}.weight"] = take(f"{a}{n}.weight")
        else:
            q_names = ("q_proj",) if cfg.q_lora_rank is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
            for n in (*q_names, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"):
                sd[f"{a}{n}.weight"] = take(f"{a}{n}.weight")
        if cfg.is_moe_layer(i):
            m = p + "block_sparse_moe."
            sd[p + "mlp.gate.weight"] = take(m + "gate.weight")
            sd[p + "mlp.gate.e_score_correction_bias"] = take(m + "gate.e_score_correction_bias")
            experts = range(cfg.num_experts)
            sd[p + "mlp.experts.gate_up_proj"] = torch.stack([
                torch.cat([take(f"{m}experts.{e}.w1.weight"), take(f"{m}experts.{e}.w3.weight")], dim=0)
                for e in experts])
            sd[p + "mlp.experts.down_proj"] = torch.stack([take(f"{m}experts.{e}.w2.weight") for e in experts])
            for n in ("gate_proj", "up_proj", "down_proj"):
                sd[f"{p}mlp.shared_experts.{n}.weight"] = take(f"{m}shared_experts.{n}.weight")
        else:
            for n in ("gate_proj", "up_proj", "down_proj"):
                sd[f"{p}mlp.{n}.weight"] = take(f"{p}mlp.{n}.weight")
    unused = sorted(set(ours) - used)
    if unused:
        raise HFMappingError(f"{len(unused)} of our tensors have no transformers destination: {unused[:8]}")
    return sd


def hf_config(hf_dict: Mapping[str, Any]) -> Any:
    """KimiLinearConfig(**config.json) with eager attention and eager (per-expert loop) experts."""
    from transformers import KimiLinearConfig

    config = KimiLinearConfig(**dict(hf_dict))
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def build_hf_model(cfg: ModelConfig, hf_dict: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                   dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> nn.Module:
    """KimiLinearForCausalLM from a kl config dict and our checkpoint tensors (strict both ways)."""
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM(hf_config(hf_dict))
    # nn.Module.to directly: transformers wraps `.to` with functools.wraps, which mypy reads as unbound
    nn.Module.to(model, dtype=dtype).eval()
    if model.config._attn_implementation != "eager" or model.config._experts_implementation != "eager":
        raise RuntimeError(f"transformers did not keep eager paths: attn={model.config._attn_implementation} "
                           f"experts={model.config._experts_implementation}")
    sd = hf_state_dict(cfg, dense_module_tensors(cfg, tensors))
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    missing, extra = sorted(set(targets) - set(sd)), sorted(set(sd) - set(targets))
    if missing or extra:
        raise HFMappingError(f"transformers tensors without a source {missing[:8]}; mapped names transformers "
                             f"lacks {extra[:8]}")
    with torch.no_grad():
        for name, dest in targets.items():
            if tuple(dest.shape) != tuple(sd[name].shape):
                raise HFMappingError(f"{name}: transformers {tuple(dest.shape)} vs ours {tuple(sd[name].shape)}")
            dest.copy_(sd[name].to(dtype))
    return nn.Module.to(model, device)  # see build_hf_model: transformers' `.to` wrapper


@torch.no_grad()
def hf_forward(model: nn.Module, input_ids: torch.Tensor,
               capture: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ids [T] -> (logits [T, V], captures with our names: layers.{i}.attn_out / ffn_out, final_hidden)."""
    captures: dict[str, torch.Tensor] = {}
    handles = []
    if capture:
        def hook(name: str) -> Any:
            def record(_mod: nn.Module, _inp: Any, out: Any) -> None:
                captures[name] = (out[0] if isinstance(out, tuple) else out)[0]  # MLA returns (out, weights)
            return record
        for i, layer in enumerate(model.get_submodule("model.layers").children()):
            handles.append(layer.get_submodule("self_attn").register_forward_hook(hook(f"layers.{i}.attn_out")))
            handles.append(layer.get_submodule("mlp").register_forward_hook(hook(f"layers.{i}.ffn_out")))
        handles.append(model.get_submodule("model.norm").register_forward_hook(hook("final_hidden")))
    try:
        device = next(model.parameters()).device
        with torch_kda_paths(device):
            out = model(input_ids=input_ids[None].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return out.logits[0], captures
