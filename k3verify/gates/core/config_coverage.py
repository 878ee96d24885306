"""Which checks watch which config field: for every ModelConfig field the serving stack reads, a wrong value
given to the serving model alone (the oracle keeps the true one) and the checks that must turn red.

A wrong value is a plausible mistake: another key's value, the usual default, a neighbouring size. Fields that
shape weights are caught by the strict loader (the serving model refuses the checkpoint, so every check that
builds it errors, naming the tensor); fields that only change numbers are caught by the module check built
for them. Fields that cannot matter on a preset are listed with the reason. tests/gates/test_config_coverage.py
runs the table (only each entry's own checks, models and caches shared per preset) and checks that it names
every field that k3verify/serving, k3verify/kernels and k3verify/api read.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3verify.config import ModelConfig

PACKAGE = Path(__file__).resolve().parents[2]
SERVING_SOURCES = ("serving", "kernels", "api")
LOAD = ("norm.sites.fp32",)  # any check that builds the serving model sees a refused checkpoint
TINY, KL, SKEW = ("k3-tiny",), ("kl-tiny",), ("k3-skew-10",)


@dataclass(frozen=True)
class Perturbation:
    """`wrong(cfg)` is the value the serving model gets; `killers` must include one red check on each preset.
    `at_load`: the strict loader refuses the checkpoint (the red check errors naming a tensor)."""

    field: str
    wrong: Callable[[ModelConfig], Any]
    killers: tuple[str, ...]
    presets: tuple[str, ...]
    mistake: str
    at_load: bool = False


@dataclass(frozen=True)
class Irrelevant:
    field: str
    presets: tuple[str, ...]
    reason: str


def _shape(field: str, wrong: Callable[[ModelConfig], Any], mistake: str,
           presets: tuple[str, ...] = TINY) -> Perturbation:
    return Perturbation(field, wrong, LOAD, presets, mistake, at_load=True)


def _first_mla(cfg: ModelConfig) -> int:
    return cfg.full_attn_layers[0]


PERTURBATIONS: tuple[Perturbation, ...] = (
    _shape("model_type", lambda c: "kimi_linear", "a K3 checkpoint read as Kimi-Linear (A_log unpadded)"),
    _shape("checkpoint_prefix", lambda c: "" if c.checkpoint_prefix else "language_model.",
           "K3's language_model. prefix dropped from the checkpoint names"),
    _shape("vocab_size", lambda c: c.vocab_size + 8, "a padded vocabulary"),
    _shape("hidden_size", lambda c: c.hidden_size + 8, "a wrong hidden size"),
    _shape("num_hidden_layers", lambda c: c.num_hidden_layers - 1, "the last layer dropped"),
    _shape("num_attention_heads", lambda c: c.num_attention_heads // 2, "MLA heads halved (KV heads read)"),
    _shape("q_lora_rank", lambda c: None, "q_proj instead of the q LoRA pair"),
    _shape("q_lora_rank", lambda c: 32, "the q LoRA pair instead of q_proj", KL),
    _shape("kv_lora_rank", lambda c: c.kv_lora_rank // 2, "a wrong latent rank"),
    _shape("qk_nope_head_dim", lambda c: c.qk_rope_head_dim, "the rope width read for nope"),
    _shape("qk_rope_head_dim", lambda c: c.qk_nope_head_dim, "the nope width read for rope"),
    _shape("v_head_dim", lambda c: c.v_head_dim // 2, "a wrong value head dim"),
    _shape("mla_use_output_gate", lambda c: False, "K3's MLA output gate left out"),
    _shape("kda_num_heads", lambda c: c.kda_num_heads - 1, "one KDA head short"),
    _shape("kda_head_dim", lambda c: c.kda_head_dim // 2, "a wrong KDA head dim"),
    _shape("conv_kernel_size", lambda c: c.conv_kernel_size - 1, "a short conv window"),
    _shape("kda_layers", lambda c: c.kda_layers[1:], "the first KDA layer built as MLA"),
    _shape("use_full_rank_gate", lambda c: False, "the low-rank output gate where K3 has g_proj"),
    _shape("intermediate_size", lambda c: c.intermediate_size // 2, "a wrong dense MLP width"),
    _shape("first_k_dense_replace", lambda c: 0, "layer 0 built as MoE"),
    _shape("moe_layer_freq", lambda c: 2, "every other layer dense"),
    _shape("moe_intermediate_size", lambda c: c.moe_intermediate_size // 2, "a wrong expert width"),
    _shape("num_experts", lambda c: c.num_experts - 1, "one expert short"),
    _shape("num_shared_experts", lambda c: c.num_shared_experts + 1, "a wrong shared-expert count"),
    _shape("routed_expert_hidden_size", lambda c: (c.routed_expert_hidden_size or 0) // 2, "a wrong latent width"),
    _shape("latent_moe_use_norm", lambda c: False, "LatentMoE without its routed_expert_norm"),
    # quant=None would be no fault: the loader dequantizes the MXFP4 pairs into dense experts, bit-identical
    _shape("quant", lambda c: dataclasses.replace(c.quant, group_size=c.quant.group_size // 2) if c.quant else None,
           "MXFP4 scales read per 16 inputs instead of 32"),
    Perturbation("full_attn_layers", lambda c: c.full_attn_layers[1:], ("serving.decode.vs_full",), TINY,
                 "the first MLA layer missing from the latent cache's layers"),
    Perturbation("rms_norm_eps", lambda c: 1e-6, ("norm.sites.fp32",), TINY + KL, "the MLA LoRA eps read for it"),
    Perturbation("gate_lower_bound", lambda c: -4.0, ("kda.gate.fp32",), TINY, "a rounded lower bound"),
    Perturbation("gate_lower_bound", lambda c: -5.0, ("kda.gate.fp32",), KL, "a safe gate where the config has none"),
    Perturbation("hidden_act", lambda c: "silu", ("mlp.act.fp32",), TINY, "SiLU where K3 has SiTU"),
    Perturbation("hidden_act", lambda c: "situ", ("mlp.act.fp32",), KL, "SiTU where Kimi-Linear has SiLU"),
    Perturbation("situ_beta", lambda c: c.situ_linear_beta, ("mlp.act.fp32",), TINY,
                 "activation_situ_linear_beta read for it"),
    Perturbation("situ_linear_beta", lambda c: c.situ_beta, ("mlp.act.fp32",), TINY,
                 "activation_situ_beta read for it"),
    Perturbation("num_experts_per_token", lambda c: c.num_experts_per_token + 1, ("router.module.fp32",), TINY,
                 "top-k off by one"),
    Perturbation("num_expert_group", lambda c: 2, ("router.module.fp32",), TINY, "grouped routing switched on"),
    Perturbation("topk_group", lambda c: c.topk_group - 1, ("router.module.fp32",), SKEW, "one group fewer"),
    Perturbation("moe_renormalize", lambda c: not c.moe_renormalize, ("router.module.fp32",), TINY,
                 "top-k weights not renormalized"),
    Perturbation("routed_scaling_factor", lambda c: 1.0, ("router.module.fp32",), TINY, "the scaling left at 1"),
    Perturbation("attn_res_block_size", lambda c: (c.attn_res_block_size or 0) + 1, ("model.logits.fp32",), TINY,
                 "blocks one layer longer"),
)

IRRELEVANT: tuple[Irrelevant, ...] = (
    Irrelevant("max_position_embeddings", TINY + KL + SKEW + ("k3-syn-25",),
               "only caps the context ModelRunner admits when no max_context is given; it enters no computation, "
               "and every check sizes its contexts explicitly (tests/serving covers the cap)"),
    Irrelevant("topk_group", TINY + KL + ("k3-syn-25",), "one expert group: routing is ungrouped whatever it says"),
    Irrelevant("situ_beta", KL, "hidden_act silu: no SiTU"),
    Irrelevant("situ_linear_beta", KL, "hidden_act silu: no SiTU"),
    Irrelevant("attn_res_block_size", KL, "no Block Attention Residuals"),
    Irrelevant("routed_expert_hidden_size", KL, "no LatentMoE"),
    Irrelevant("latent_moe_use_norm", KL, "no LatentMoE"),
    Irrelevant("mla_use_output_gate", KL, "a kimi_k3 feature (the config parser refuses it for kimi_linear)"),
    Irrelevant("quant", KL, "dense experts"),
)


def perturbed(cfg: ModelConfig, p: Perturbation) -> ModelConfig:
    return dataclasses.replace(cfg, **{p.field: p.wrong(cfg)})


def config_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(ModelConfig)}


def _self_reads(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}


def derived_reads() -> dict[str, set[str]]:
    """ModelConfig property / method name -> the dataclass fields it reads (through other properties too)."""
    tree = ast.parse((PACKAGE / "config.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelConfig")
    direct = {fn.name: _self_reads(fn) for fn in cls.body if isinstance(fn, ast.FunctionDef)}
    fields = config_fields()

    def resolve(name: str, seen: frozenset[str]) -> set[str]:
        out: set[str] = set()
        for attr in direct.get(name, set()):
            if attr in fields:
                out.add(attr)
            elif attr in direct and attr not in seen:
                out |= resolve(attr, seen | {attr})
        return out
    return {name: resolve(name, frozenset({name})) for name in direct}


def fields_read(sources: Iterable[str] = SERVING_SOURCES) -> dict[str, set[str]]:
    """Config field -> the files (relative to the package) whose code reads it as `<x>.cfg.<name>` or `cfg.<name>`."""
    fields, derived = config_fields(), derived_reads()
    out: dict[str, set[str]] = {}
    for sub in sources:
        for path in sorted((PACKAGE / sub).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Attribute) and _is_cfg(node.value)):
                    continue
                names = {node.attr} & fields or derived.get(node.attr, set())
                for name in names:
                    out.setdefault(name, set()).add(str(path.relative_to(PACKAGE)))
    return out


def _is_cfg(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "cfg") or (isinstance(node, ast.Attribute) and node.attr == "cfg")
