"""transformers' KimiLinear oracle: a one-to-one name map and forced torch KDA paths on CPU."""

from __future__ import annotations

import pytest
import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.oracle import hf_kimi_linear as hf
from k3verify.presets import get_preset


def _ours() -> dict[str, torch.Tensor]:
    cfg = get_preset("kl-tiny")
    return hf.dense_module_tensors(cfg, synthetic_tensors(cfg, seed=0))


def test_state_dict_map_uses_every_tensor_once_and_fuses_as_transformers_expects() -> None:
    """conv1d = cat(q, k, v) on dim 0; gate_up_proj = stack(cat(w1, w3)); down_proj = stack(w2)."""
    cfg, ours = get_preset("kl-tiny"), _ours()
    sd = hf.hf_state_dict(cfg, ours)
    p = "model.layers.1."
    conv = sd[p + "self_attn.conv1d.weight"]
    D = cfg.kda_dim
    assert torch.equal(conv[D:2 * D], ours[p + "self_attn.k_conv1d.weight"])
    gate_up = sd[p + "mlp.experts.gate_up_proj"]
    assert gate_up.shape == (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert torch.equal(gate_up[3, cfg.moe_intermediate_size:], ours[p + "block_sparse_moe.experts.3.w3.weight"])
    assert torch.equal(sd[p + "mlp.experts.down_proj"][5], ours[p + "block_sparse_moe.experts.5.w2.weight"])
    assert torch.equal(sd[p + "self_attn.forget_gate.A_log"], ours[p + "self_attn.A_log"])


def test_state_dict_map_rejects_missing_and_unused_tensors() -> None:
    """A missing source or a tensor with no destination raises, naming it."""
    cfg, ours = get_preset("kl-tiny"), _ours()
    missing = dict(ours)
    del missing["model.layers.2.self_attn.dt_bias"]
    with pytest.raises(hf.HFMappingError, match="model.layers.2.self_attn.dt_bias"):
        hf.hf_state_dict(cfg, missing)
    with pytest.raises(hf.HFMappingError, match="stray"):
        hf.hf_state_dict(cfg, {**ours, "model.layers.0.stray.weight": torch.zeros(1)})


def test_state_dict_map_refuses_k3() -> None:
    """K3 has features transformers' KimiLinear lacks: the map refuses instead of dropping them."""
    with pytest.raises(hf.HFMappingError, match="K3"):
        hf.hf_state_dict(get_preset("k3-tiny"), {})


def test_torch_kda_paths_route_to_torch_functions_and_restore() -> None:
    """Inside the context the module globals ARE transformers' torch functions; afterwards the
    decorated (fla-preferring) ones are back."""
    mod = hf.modeling_module()
    before = {n: getattr(mod, n) for n in hf.KDA_FUNCTIONS}
    assert all(hasattr(f, "__wrapped__") for f in before.values())
    with hf.torch_kda_paths(torch.device("cpu")) as routing:
        for name in hf.KDA_FUNCTIONS:
            fn = getattr(mod, name)
            assert not hasattr(fn, "__wrapped__") and fn.__code__.co_filename == mod.__file__
            assert "[torch]" in routing[name]
    assert {n: getattr(mod, n) for n in hf.KDA_FUNCTIONS} == before
