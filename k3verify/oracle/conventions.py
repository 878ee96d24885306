"""Known alternative conventions: constants public Kimi implementations disagree on, and how to compute the oracle
with one of them instead of the released code's.

An entry names a site (`kda.l2norm_eps`), the released code's value, and the alternatives seen or modelled, each
with the implementations known to use it and the serving-side mutant (mutations/) that injects it. `applied(...)`
makes every oracle forward inside it compute with the given alternatives: the oracle's modules read these knobs at
forward time (oracle/active.py), so cached models honour it, in any dtype. docs/conventions.md is the prose.

    assignment = parse_assignment("mla.lora_norm_eps=rms_norm_eps", cfg)   # value resolved from cfg: 1e-05
    with applied([assignment]):
        logits = oracle(ids).logits

Like active.py, `applied` is not thread-safe: one block at a time per process.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from k3verify.config import ModelConfig
from k3verify.oracle import active

RMS_NORM_EPS = "rms_norm_eps"  # an eps value written as the config's rms_norm_eps, resolved per config
LLAMA_K3 = "llama.cpp src/models/kimi-k3.cpp"
LLAMA_KL = "llama.cpp src/models/kimi-linear.cpp"
# identifiable_on below is measured (tools/measure_conventions.py) and pinned by tests/oracle/test_conventions.py
_K3 = ("k3-tiny", "k3-syn-25", "k3-skew-10", "k3-tp4")
_ALL = ("k3-tiny", "k3-syn-25", "k3-skew-10", "kl-tiny", "k3-tp4")
# LatentMoE's routed_expert_norm normalises the scaling away except through its eps: visible where the latent
# combine is small against that eps, and in Kimi-Linear (no LatentMoE). Not claimed on k3-skew-10: there the oracle's
# own fp32-vs-fp64 distance depends on the CPU's GEMM kernels, and on some CPUs it leaves the effect under the 100x rule
_SCALING_VISIBLE = ("k3-syn-25", "kl-tiny")


@dataclass(frozen=True)
class Alternative:
    """One value other than the released one, as written after `NAME=`; `used_by` cites the public implementations
    known to compute with it (empty: none known); `mutant` is the catalog mutant that injects it into our server;
    `identifiable_on` the synthetic presets where it moves the oracle's fp32 whole-model logprobs far beyond fp32
    noise (measured: docs/conventions.md)."""

    value: str
    used_by: tuple[str, ...] = ()
    mutant: str | None = None
    identifiable_on: tuple[str, ...] = ()

    @property
    def seen_in(self) -> str:
        """The implementations' names ("llama.cpp, vLLM"), or "none known"."""
        names = dict.fromkeys(entry.split(" ", 1)[0] for entry in self.used_by)
        return ", ".join(names) or "none known"


@dataclass(frozen=True)
class Convention:
    """A site where implementations differ. `kind` "eps" takes any number >= 0 or `rms_norm_eps`; "choice" takes
    one of `choices`. `knobs` are the oracle knobs it sets (its own name unless it sets several sites at once).
    `precision` entries change only a run below fp32 (they move a step to the activation dtype)."""

    name: str
    site: str
    released: str
    alternatives: tuple[Alternative, ...]
    requires: Callable[[ModelConfig], str | None] = field(repr=False)
    kind: str = "eps"
    choices: tuple[str, ...] = ()
    knobs: tuple[str, ...] = ()
    precision: bool = False

    def __post_init__(self) -> None:
        if not self.knobs:
            object.__setattr__(self, "knobs", (self.name,))

    def applies(self, cfg: ModelConfig) -> bool:
        """The site exists in this config."""
        return self.requires(cfg) is None

    @property
    def identifiable_on(self) -> tuple[str, ...]:
        """Presets where at least one of its alternatives is identifiable."""
        return tuple(dict.fromkeys(p for alt in self.alternatives for p in alt.identifiable_on))

    @property
    def mutants(self) -> tuple[str, ...]:
        return tuple(alt.mutant for alt in self.alternatives if alt.mutant is not None)

    def resolve(self, text: str, cfg: ModelConfig) -> Any:
        """The value `text` means for this config (an eps as float, a choice as str); ValueError naming the valid
        values otherwise."""
        text = text.strip()
        if self.kind == "choice":
            if text not in self.choices:
                raise ValueError(f"{self.name}={text!r}: not a value of {self.name}; valid: {', '.join(self.choices)}")
            return text
        if text == RMS_NORM_EPS:
            return float(cfg.rms_norm_eps)
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{self.name}={text!r}: an eps is a number >= 0 or {RMS_NORM_EPS!r} (the config's "
                             f"{cfg.rms_norm_eps:g}); catalogued: {', '.join(_values(self))}")
        return value

    def released_value(self, cfg: ModelConfig) -> Any:
        return self.resolve(self.released, cfg)


@dataclass(frozen=True)
class Assignment:
    """`NAME=VALUE` resolved for one config: `value` is what the oracle's knobs are set to."""

    convention: Convention
    value_text: str
    value: Any

    @property
    def alternative(self) -> Alternative | None:
        """The catalog's alternative written the same way, if any."""
        return next((a for a in self.convention.alternatives if a.value == self.value_text), None)

    @property
    def mutant(self) -> str | None:
        alt = self.alternative
        return alt.mutant if alt is not None else None

    @property
    def text(self) -> str:
        """`name=value`, with the resolved number when the value was symbolic: `mla.lora_norm_eps=rms_norm_eps
        (1e-05)`."""
        shown = f"{self.convention.name}={self.value_text}"
        return f"{shown} ({self.value:g})" if self.value_text == RMS_NORM_EPS else shown


def _values(conv: Convention) -> list[str]:
    return [conv.released] + [a.value for a in conv.alternatives]


def _needs(what: str, test: Callable[[ModelConfig], bool]) -> Callable[[ModelConfig], str | None]:
    return lambda cfg: None if test(cfg) else f"this config has no {what}"


def _has_moe(cfg: ModelConfig) -> bool:
    return any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


_KDA = _needs("KDA layers", lambda c: c.has_kda)
_MLA = _needs("MLA layers", lambda c: c.has_mla)
_Q_LORA = _needs("MLA q_a_layernorm (q_lora_rank is null)", lambda c: c.has_mla and c.q_lora_rank is not None)
_ATTN_RES = _needs("Block Attention Residuals (attn_res_block_size)", lambda c: c.uses_attn_res)
_MOE = _needs("MoE layers", _has_moe)
_LATENT_NORM = _needs("LatentMoE routed_expert_norm", lambda c: c.uses_latent_moe and c.latent_moe_use_norm)
_SAFE_GATE = _needs("KDA gate_lower_bound (safe gate)", lambda c: c.has_kda and c.gate_lower_bound is not None)
_RENORM = _needs("renormalised top-k routing (moe_renormalize with more than one expert per token)",
                 lambda c: _has_moe(c) and c.moe_renormalize and c.num_experts_per_token > 1)
_SCALING = _needs("routed_scaling_factor other than 1", lambda c: _has_moe(c) and c.routed_scaling_factor != 1)


def _layer_eps(name: str, site: str, requires: Callable[[ModelConfig], str | None], *,
               mutant_1e6: str | None = None, mutant_1e5: str | None = None, used_by_1e5: tuple[str, ...] = (),
               identifiable_1e6: tuple[str, ...] = (), identifiable_1e5: tuple[str, ...] = ()) -> Convention:
    """A norm that reads rms_norm_eps in the released code: hard-coding 1e-6 (a common RMSNorm default) or 1e-5
    (the usual config value, identical wherever the config says 1e-5) are the ways to get it wrong."""
    return Convention(name, site, RMS_NORM_EPS, (
        Alternative("1e-6", mutant=mutant_1e6, identifiable_on=identifiable_1e6),
        Alternative("1e-5", used_by=used_by_1e5, mutant=mutant_1e5, identifiable_on=identifiable_1e5)), requires)


CATALOG: tuple[Convention, ...] = (
    Convention(
        "kda.l2norm_eps", "the KDA q and k L2 norm before the recurrence, x / sqrt(sum x^2 + eps)", "1e-6",
        (Alternative(RMS_NORM_EPS, used_by=(f"{LLAMA_KL} (build_gdn_l2_norm with f_norm_rms_eps)",
                                            f"{LLAMA_K3} (build_gdn_l2_norm with f_norm_rms_eps)")),), _KDA),
    Convention(
        "mla.lora_norm_eps", "both MLA LoRA norms (q_a_layernorm and kv_a_layernorm) together", "1e-6",
        (Alternative(RMS_NORM_EPS, mutant="mla.lora_norm.eps_1e5", identifiable_on=_K3,
                     used_by=(f"{LLAMA_K3} (build_norm with f_norm_rms_eps)",
                              "vLLM K3 MLA (RMSNorm(rank, eps=config.rms_norm_eps))")),),
        _Q_LORA, knobs=("mla.q_a_norm_eps", "mla.kv_a_norm_eps")),
    Convention(
        "mla.q_a_norm_eps", "the MLA q_a_layernorm alone (kv_a_layernorm at its own eps)", "1e-6",
        (Alternative(RMS_NORM_EPS, mutant="norm.eps.q_a_layernorm", identifiable_on=_K3),), _Q_LORA),
    Convention(
        "mla.kv_a_norm_eps", "the MLA kv_a_layernorm alone (the only LoRA norm without q_lora_rank)", "1e-6",
        (Alternative(RMS_NORM_EPS, mutant="norm.eps.kv_a_layernorm", identifiable_on=_ALL,
                     used_by=(f"{LLAMA_KL} (build_norm with f_norm_rms_eps; Kimi-Linear has no q_a norm)",
                              "vLLM vllm/model_executor/models/kimi_linear.py (RMSNorm(kv_lora_rank, "
                              "eps=config.rms_norm_eps); Kimi-Linear has no q_a norm)")),), _MLA),
    _layer_eps("norm.input_layernorm_eps", "every layer's input_layernorm", lambda c: None,
               mutant_1e6="norm.eps.input_layernorm", identifiable_1e6=("k3-syn-25", "k3-skew-10")),
    _layer_eps("norm.post_attention_layernorm_eps", "every layer's post_attention_layernorm", lambda c: None,
               mutant_1e5="norm.eps.post_attention_layernorm_default", identifiable_1e6=("k3-syn-25",)),
    _layer_eps("norm.final_norm_eps", "the final model.norm before lm_head", lambda c: None,
               mutant_1e6="norm.eps.final_norm"),
    _layer_eps("kda.o_norm_eps", "the KDA gated output norm (o_norm, per head)", _KDA, mutant_1e6="norm.eps.kda_o_norm",
               identifiable_1e6=_ALL, identifiable_1e5=("k3-skew-10",),
               used_by_1e5=("vLLM vllm/model_executor/layers/kda.py (KimiDeltaAttention's rms_norm_eps defaults to "
                            "1e-5; models/kimi_linear.py does not pass the config's)",)),
    _layer_eps("moe.latent_norm_eps", "LatentMoE's routed_expert_norm after the combine", _LATENT_NORM,
               mutant_1e6="norm.eps.routed_expert_norm"),  # k3-syn-25: under 100x its CPU-dependent own distance
    _layer_eps("attn_res.layer_mix_eps", "the key norm of the depth mixes inside the layers", _ATTN_RES,
               mutant_1e6="attn_res.eps.layer_mix", identifiable_1e6=("k3-syn-25",)),
    _layer_eps("attn_res.output_mix_eps", "the key norm of the model-level output mix", _ATTN_RES,
               mutant_1e6="attn_res.eps.output_mix"),
    Convention(
        "router.renorm_eps", "the router's top-k renormalisation, w / (sum w + eps)", "1e-20",
        (Alternative("0", used_by=("llama.cpp src/llama-graph.cpp (build_moe_ffn divides by the sum clamped at "
                                   ">= 6.1e-5, no eps: the same as 0 for any larger sum)",)),), _RENORM),
    Convention(
        "router.scaling", "where routed_scaling_factor multiplies the top-k weights", "after_renorm",
        (Alternative("none", mutant="router.no_scaling_factor", identifiable_on=_SCALING_VISIBLE,
                     used_by=("DeepSeek-V2 modeling_deepseek.py MoEGate (scales only when it does not renormalise)",)),
         Alternative("before_renorm", identifiable_on=_SCALING_VISIBLE)),
        _SCALING, kind="choice", choices=("after_renorm", "before_renorm", "none")),
    Convention(
        "kda.conv_activation", "the activation after each KDA short causal conv", "silu",
        (Alternative("none", mutant="kda.conv.silu_dropped_everywhere", identifiable_on=_ALL),), _KDA, kind="choice",
        choices=("silu", "none")),
    Convention(
        "kda.gate", "the KDA forget gate: lower-bounded L*sigmoid(exp(A)*g) or plain -exp(A)*softplus(g)", "safe",
        (Alternative("plain", mutant="kda.gate.softplus_for_safe_gate", identifiable_on=_K3),), _SAFE_GATE,
        kind="choice", choices=("safe", "plain")),
    Convention(
        "mla.softmax_precision", "the MLA attention softmax's exp, sum and division", "float32",
        (Alternative("activation", mutant="mla.decode.softmax_in_bf16"),), _MLA, kind="choice",
        choices=("float32", "activation"), precision=True),
    Convention(
        "attn_res.softmax_precision", "the depth mixes' softmax scores", "float32",
        (Alternative("activation", mutant="attn_res.softmax_in_bf16"),), _ATTN_RES, kind="choice",
        choices=("float32", "activation"), precision=True),
    Convention(
        "moe.combine_precision", "the accumulator of the weighted routed-expert outputs", "float32",
        (Alternative("activation", mutant="moe.combine_in_bf16"),), _MOE, kind="choice",
        choices=("float32", "activation"), precision=True),
)

_BY_NAME = {c.name: c for c in CATALOG}


def by_name(name: str) -> Convention:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown convention {name!r}; known: {', '.join(_BY_NAME)}") from None


def parse_assignment(text: str, cfg: ModelConfig) -> Assignment:
    """`NAME=VALUE` (as `--accept-convention` takes it) resolved for `cfg`; ValueError naming the valid names, the
    valid values, or why the site does not exist in this config."""
    name, sep, value_text = text.partition("=")
    name, value_text = name.strip(), value_text.strip()
    if not sep or not name or not value_text:
        raise ValueError(f"{text!r}: expected NAME=VALUE, e.g. mla.lora_norm_eps=rms_norm_eps; "
                         f"names: {', '.join(_BY_NAME)}")
    if name not in _BY_NAME:
        raise ValueError(f"{text!r}: unknown convention {name!r}; known: {', '.join(_BY_NAME)}")
    conv = _BY_NAME[name]
    why_not = conv.requires(cfg)
    if why_not is not None:
        raise ValueError(f"{text!r}: {name} does not apply to this checkpoint: {why_not}")
    return Assignment(conv, value_text, conv.resolve(value_text, cfg))


def alternatives_for(cfg: ModelConfig, dtype: torch.dtype | None = None) -> list[Assignment]:
    """Every (convention, alternative) that applies to `cfg` and changes something there: an alternative that
    resolves to the released value (1e-5 where rms_norm_eps is 1e-5), or to one listed before it, is left out.
    With `dtype` fp32 or fp64, the precision entries (no-ops at that precision) are left out too."""
    out: list[Assignment] = []
    for conv in CATALOG:
        if not conv.applies(cfg) or (conv.precision and dtype in (torch.float32, torch.float64)):
            continue
        seen = [conv.released_value(cfg)]
        for alt in conv.alternatives:
            value = conv.resolve(alt.value, cfg)
            if value not in seen:
                seen.append(value)
                out.append(Assignment(conv, alt.value, value))
    return out


@contextlib.contextmanager
def applied(assignments: Sequence[Assignment]) -> Iterator[None]:
    """Every oracle forward inside the block computes with these conventions; on exit (exceptions included) it
    computes exactly as before. Two assignments that set the same site to different values are refused."""
    knobs: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for a in assignments:
        for knob in a.convention.knobs:
            if knob in knobs and knobs[knob] != a.value:
                raise ValueError(f"{a.text} and {owner[knob]} set {knob} to different values")
            knobs[knob], owner[knob] = a.value, a.text
    with active.overriding(knobs):
        yield

