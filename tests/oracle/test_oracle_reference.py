"""K3Reference: names, contract, determinism and the residual algebra."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from k3verify.checkpoint.loader import load_into
from k3verify.checkpoint.names import module_specs
from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.config import ModelConfig
from k3verify.oracle import functional as Fn
from k3verify.oracle.k3_reference import K3Reference, expected_module_names
from k3verify.presets import SYNTHETIC_PRESETS, get_preset


@functools.cache
def _tensors(name: str) -> dict[str, torch.Tensor]:
    return synthetic_tensors(get_preset(name), seed=0)


def _loaded(name: str, dtype: torch.dtype = torch.float32) -> K3Reference:
    cfg = get_preset(name)
    ref = K3Reference(cfg, dtype)
    load_into(ref, cfg, _tensors(name))
    return ref


def _ids(cfg: ModelConfig, T: int = 21, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", SYNTHETIC_PRESETS)
def test_reference_runs_every_synthetic_preset_without_nan(name: str) -> None:
    """Strict load + forward on k3-tiny, k3-syn-25, k3-skew-10 and kl-tiny: finite logits, full captures."""
    ref = _loaded(name)
    cfg = ref.cfg
    out = ref(_ids(cfg), capture=True)
    assert out.logits.shape == (21, cfg.vocab_size) and out.logits.dtype == torch.float32
    assert bool(torch.isfinite(out.logits).all()), f"{name}: non-finite logits"
    expected = {f"layers.{i}.{k}" for i in range(cfg.num_hidden_layers) for k in ("attn_out", "ffn_out")}
    assert set(out.captures) == expected | {"final_hidden"}
    assert all(t.shape == (21, cfg.hidden_size) for t in out.captures.values())


def test_module_tree_mirrors_checkpoint_names() -> None:
    """Parameter names equal module_specs, MXFP4 pairs held as dense wN.weight (k3-tiny is quantized)."""
    cfg = get_preset("k3-tiny")
    names = set(dict(K3Reference(cfg).named_parameters()))
    specs = module_specs(cfg)
    assert any(n.endswith("w1.weight_packed") for n in specs), "k3-tiny should ship MXFP4 experts"
    assert names == set(expected_module_names(cfg))
    dense_only = {n for n in specs if "experts." not in n or "shared_experts" in n}
    assert dense_only <= names


def test_bf16_reference_keeps_checkpoint_fp32_tensors_wide() -> None:
    """A bf16 reference stores K3's fp32 conv weights, A_log, dt_bias and router bias in fp32."""
    ref = K3Reference(get_preset("k3-tiny"), torch.bfloat16)
    attn = ref.model.layers[0].self_attn
    assert attn.q_conv1d.weight.dtype == attn.A_log.dtype == attn.dt_bias.dtype == torch.float32
    assert ref.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.dtype == torch.float32
    assert attn.q_proj.weight.dtype == torch.bfloat16


def test_a_log_allocated_at_stored_width() -> None:
    """K3 allocates A_log [a_log_width] (padded past the heads); Kimi-Linear keeps (1, 1, heads, 1)."""
    k3, kl = get_preset("k3-tiny"), get_preset("kl-tiny")
    assert K3Reference(k3).model.layers[0].self_attn.A_log.shape == (k3.a_log_width,)
    assert k3.a_log_width > k3.kda_num_heads
    assert K3Reference(kl).model.layers[0].self_attn.A_log.shape == (1, 1, kl.kda_num_heads, 1)


def test_a_log_pad_poison_changes_nothing() -> None:
    """A_log beyond [:heads] is poisoned with 1e6 in the checkpoint; re-poisoning it changes no bit,
    while touching a used entry does change the output (so the comparison can fail)."""
    ref = _loaded("k3-tiny")
    cfg, ids = ref.cfg, _ids(ref.cfg)
    base = ref(ids).logits
    a_log = ref.model.layers[cfg.kda_layers[0]].self_attn.A_log
    h = cfg.kda_num_heads
    assert bool((a_log[h:] == 1e6).all())
    with torch.no_grad():
        a_log[h:] = -3.0
    assert torch.equal(ref(ids).logits, base)
    with torch.no_grad():
        a_log[0] += 0.5
    assert not torch.equal(ref(ids).logits, base)


def test_forward_twice_identical() -> None:
    """Nothing leaks from one forward to the next (block list, scratch): two runs are bit-identical."""
    ref = _loaded("k3-skew-10")
    ids = _ids(ref.cfg, 17)
    first = ref(ids, capture=True)
    other = ref(_ids(ref.cfg, 9, seed=5))
    second = ref(ids, capture=True)
    assert torch.equal(first.logits, second.logits)
    assert all(torch.equal(first.captures[k], second.captures[k]) for k in first.captures)
    assert other.logits.shape[0] == 9


@pytest.mark.parametrize("name", ["k3-tiny", "kl-tiny"])
def test_fp64_and_fp32_close(name: str) -> None:
    """fp32 logits within 1e-4 relative RMS of fp64 (fp64 also runs the KDA recurrence in fp64)."""
    ids = _ids(get_preset(name), 33)
    lo, hi = _loaded(name)(ids).logits, _loaded(name, torch.float64)(ids).logits
    assert hi.dtype == torch.float64
    rel = float((lo.double() - hi).norm() / hi.norm())
    assert 0.0 < rel < 1e-4, rel


def test_submodule_contract_one_sequence_in_same_shape_out() -> None:
    """Each sublayer maps [T, H] -> [T, H]; the gate returns fp32 weights and ascending int64 ids."""
    ref = _loaded("k3-tiny")
    cfg = ref.cfg
    x = torch.randn(11, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    for i, layer in enumerate(ref.model.layers):
        assert layer.self_attn(x).shape == x.shape
        assert layer.input_layernorm(x).shape == x.shape
        assert layer.ffn(x).shape == x.shape, i
    w, idx = ref.model.layers[1].block_sparse_moe.gate(x)
    assert w.shape == idx.shape == (11, cfg.num_experts_per_token)
    assert w.dtype == torch.float32 and idx.dtype == torch.int64
    assert torch.equal(idx, idx.sort(-1).values)


def test_block_attention_residual_algebra_unrolled() -> None:
    """Three layers, block size 2, stub sublayers: the decoder equals SPEC §5 written out by hand
    (append p at layers 0 and 2, p reset to None, mixed h feeds only norms, mix-then-norm)."""
    base = get_preset("k3-tiny")
    cfg = dataclasses.replace(base, num_hidden_layers=3, kda_layers=(0, 1), full_attn_layers=(2,),
                              attn_res_block_size=2)
    ref = K3Reference(cfg)
    load_into(ref, cfg, synthetic_tensors(cfg, seed=0))
    layers = ref.model.layers
    for i, layer in enumerate(layers):  # stubs: distinct, nonlinear, and blind to the norms' weights
        layer.attn_sublayer = lambda h, i=i: torch.tanh(h * (0.5 + i)) + 0.1 * i
        layer.ffn_sublayer = lambda h, i=i: torch.sin(h) * (1.0 + 0.3 * i)
    ids = _ids(cfg, 6)
    eps = cfg.rms_norm_eps

    def mix(i: int, pair: str, p: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        lay = layers[i]
        return Fn.attn_res_mix(p, blocks, getattr(lay, f"{pair}_norm").weight, getattr(lay, f"{pair}_proj").weight,
                               eps)

    A = [layers[i].attn_sublayer for i in range(3)]
    Fm = [layers[i].ffn_sublayer for i in range(3)]
    p0 = ref.model.embed_tokens.weight[ids]
    a0 = A[0](p0)  # layer 0: B empty -> h = p0; then B = [p0], p = None -> p = a0
    p = a0 + Fm[0](mix(0, "mlp_res", a0, [p0]))
    a1 = A[1](mix(1, "self_attention_res", p, [p0]))  # layer 1: no boundary
    p = p + a1
    p = p + Fm[1](mix(1, "mlp_res", p, [p0]))
    h2 = mix(2, "self_attention_res", p, [p0])  # layer 2: boundary, B = [p0, p], p reset
    blocks = [p0, p]
    a2 = A[2](h2)
    p = a2 + Fm[2](mix(2, "mlp_res", a2, blocks))
    out = Fn.attn_res_mix(p, blocks, ref.model.output_attn_res_norm.weight, ref.model.output_attn_res_proj.weight, eps)
    expected = Fn.linear(ref.model.norm(out), ref.lm_head.weight)
    assert torch.equal(ref(ids).logits, expected)
