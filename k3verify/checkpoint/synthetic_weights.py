"""Name-seeded synthetic weights: every tensor's values depend only on (seed, checkpoint name).

Both stacks therefore get identical values whatever their construction order. Distributions are
chosen so that bugs show: norm gains U(0.8, 1.2) (not 1.0), A_log = log U(1, 16) with the padding
poisoned, q_a / kv_a latents small enough that an eps of 1e-5 vs 1e-6 is visible, expert gate/up
weights large enough to drive SiTU into both tanh caps, a correction bias big enough to flip
router selections.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence

import torch

from k3verify.checkpoint import mxfp4
from k3verify.checkpoint.names import TensorSpec, checkpoint_specs
from k3verify.config import ModelConfig

A_LOG_PAD_POISON = 1.0e6  # a wrong A_log slice turns exp(A_log) into inf: loud, not subtle


def _gen(seed: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return g


def _normal(shape: tuple[int, ...], std: float, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32, device=g.device) * std


def _uniform(shape: tuple[int, ...], lo: float, hi: float, g: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=g, dtype=torch.float32, device=g.device) * (hi - lo) + lo


def _dense_value(cfg: ModelConfig, spec: TensorSpec, role: str, g: torch.Generator) -> torch.Tensor:
    shape = spec.shape
    fan_in = shape[-1] if len(shape) > 1 else shape[0]
    if role == "norm":
        return _uniform(shape, 0.8, 1.2, g)
    if role in ("linear", "glu_down_silu"):
        return _normal(shape, fan_in**-0.5, g)
    if role == "embed":
        return _normal(shape, 1.0, g)
    if role == "lm_head":
        return _normal(shape, fan_in**-0.5, g)
    if role == "lora_a":  # latent rms ~3e-3: rms-norm eps 1e-5 vs 1e-6 changes the output visibly
        return _normal(shape, 3e-3 * fan_in**-0.5, g)
    if role == "kv_a":
        w = _normal(shape, fan_in**-0.5, g)
        w[: cfg.kv_lora_rank] *= 3e-3
        return w
    if role == "res_proj":
        return _normal(shape, 2.0 * fan_in**-0.5, g)
    if role == "conv":
        return _normal(shape, 0.5, g)
    if role == "a_log":
        n = cfg.kda_num_heads
        vals = torch.log(_uniform((n,), 1.0, 16.0, g))
        if cfg.is_k3:
            out = torch.full(shape, A_LOG_PAD_POISON, device=g.device)
            out[:n] = vals
            return out
        return vals.view(shape)
    if role == "dt_bias":  # fla's init: dt ~ logU(1e-3, 1e-1), stored as inverse softplus
        dt = torch.exp(_uniform(shape, math.log(1e-3), math.log(1e-1), g)).clamp_min(1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    if role == "dt_bias_safe":  # safe gate L*sigmoid(exp(A_log)*x): keep x near 0 so the gate spans [L, 0)
        return _normal(shape, 0.3, g)
    if role == "router":
        return _normal(shape, fan_in**-0.5, g)
    if role == "router_bias":
        return _normal(shape, 0.1, g)
    if role.startswith("glu_gate"):  # SiTU: |g| well past beta=4 for a good share of elements
        return _normal(shape, (3.0 if role.endswith("situ") else 1.0) * fan_in**-0.5, g)
    if role.startswith("glu_up"):  # SiTU linear cap beta_lin=25: reach it on the tail
        return _normal(shape, (10.0 if role.endswith("situ") else 1.0) * fan_in**-0.5, g)
    if role == "glu_down":
        return _normal(shape, 0.1 * fan_in**-0.5, g)
    raise ValueError(f"no synthetic distribution for role {role!r}")


def synthetic_tensors(cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """All checkpoint tensors (checkpoint names, checkpoint dtypes) for a synthetic model.

    Values depend on the device's generator: a CUDA build (used for GPU-sized benchmarks) gives other
    values than the CPU build, which is the one checkpoints and CPU checks use."""
    specs = checkpoint_specs(cfg)
    return synthetic_group(cfg, specs, list(specs), seed, device)


def synthetic_group(cfg: ModelConfig, specs: Mapping[str, TensorSpec], names: Sequence[str], seed: int = 0,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The synthetic values of `names` only (each depends on (seed, name) alone, so a checkpoint can be written
    shard by shard with the same bytes as all at once). An MXFP4 half is quantized from its pair's dense draw."""
    out: dict[str, torch.Tensor] = {}
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # both halves come from one quantization
    for name in names:
        spec = specs[name]
        if spec.role.startswith("mxfp4:"):
            base, part = name.rsplit(".", 1)
            if base not in pairs:
                packed_spec = specs[f"{base}.weight_packed"]
                dense_shape = (packed_spec.shape[0], packed_spec.shape[1] * 2)
                dense = _dense_value(cfg, TensorSpec(dense_shape, torch.float32, spec.role[6:]), spec.role[6:],
                                     _gen(seed, f"{base}.weight", device))
                pairs[base] = mxfp4.quantize(dense, cfg.mxfp4_group_size)
            out[name] = pairs[base][0] if part == "weight_packed" else pairs[base][1]
            continue
        value = _dense_value(cfg, spec, spec.role, _gen(seed, name, device))
        out[name] = value.to(spec.dtype).contiguous()
    return out
