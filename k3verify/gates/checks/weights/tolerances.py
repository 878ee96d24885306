"""The named tolerance rules (checkpoint/tolerances.py) hold exactly what they name, in the reconciler and the loader.

`weights.reconcile.tolerances` writes a header-only copy of the run's checkpoint with edits a real checkpoint
carries (an fp32 router, an A_log padded past the heads or stored in bf16) and edits no rule may excuse (an A_log
shorter than the heads, an fp32 norm, a bf16 correction bias), and records whether each lands where it must:
matched under its rule, or a mismatch. `weights.loader.tolerances` loads the checkpoint with the tolerated edits
and compares every loaded byte with the rule applied by hand here; an A_log shorter than the heads must be refused.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from k3verify.checkpoint import buckets as reconcile_mod
from k3verify.checkpoint import loader as loader_mod
from k3verify.checkpoint.buckets import ReconcileResult, build_param_module, reconcile_checkpoint
from k3verify.checkpoint.loader import WeightLoadError, load_into
from k3verify.checkpoint.names import module_specs
from k3verify.checkpoint.reader import CheckpointReader
from k3verify.checkpoint.synthetic import SYNTHETIC_SHARD_MAX_BYTES
from k3verify.checkpoint.writer import write_sparse_checkpoint
from k3verify.config import ModelConfig
from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.patch import patched

PAD_VALUE = 1.0e6  # what the loader must never read


def _targets(cfg: ModelConfig, kda_layers: int) -> tuple[str, list[str], str, str]:
    """(router weight, the first `kda_layers` A_log names, norm, correction bias) under the module names."""
    moe = next((i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)), None)
    if moe is None or len(cfg.kda_layers) < kda_layers:
        raise SkipCheck(f"needs a MoE layer and {kda_layers} KDA layer(s) (router and A_log rules)")
    router = f"model.layers.{moe}.block_sparse_moe.gate."
    a_logs = [f"model.layers.{i}.self_attn.A_log" for i in cfg.kda_layers[:kda_layers]]
    return router + "weight", a_logs, "model.norm.weight", router + "e_score_correction_bias"


def _long_a_log(cfg: ModelConfig) -> int:
    """A length past the module's width (K3 pads to a power of two; other writers to the head dim)."""
    return max(cfg.kda_head_dim, cfg.a_log_width + 3)


@contextlib.contextmanager
def _rules_off() -> Iterator[None]:
    """Control: the reconciler and the loader with every tolerance rule switched off."""
    with patched(reconcile_mod, "dtype_rule", lambda *a: None), \
            patched(reconcile_mod, "shape_rule", lambda *a: None), \
            patched(loader_mod, "shape_rule", lambda *a: None):
        yield


@register_check(id="weights.reconcile.tolerances", component="weights", level="module", kind=Kind.BITEXACT,
                control="the reconciler with every tolerance rule switched off")
def check_reconcile_tolerances(ctx: CheckContext) -> Trial:
    cfg, prefix = ctx.cfg, ctx.cfg.checkpoint_prefix
    router, a_logs, norm, bias = _targets(cfg, 2)  # one copy carries both A_log edits
    if ctx.target.names == "transformers":
        raise SkipCheck("the edits are written under published names; this checkpoint uses transformers' names "
                        "(the rules themselves run in weights.reconcile.buckets on it)")
    specs = {n: (tuple(e.shape), e.torch_dtype) for n, e in CheckpointReader(ctx.checkpoint_dir).entries.items()}
    Spec = tuple[tuple[int, ...], torch.dtype]
    long_a_log: Spec
    bad_a_log: Spec
    if cfg.is_k3:  # stored [width]: padded longer is tolerated, shorter than the heads is not
        long_a_log = ((_long_a_log(cfg),), torch.float32)
        bad_a_log = ((cfg.kda_num_heads - 1,), torch.float32)
        a_log_rule = "a_log_padding"
    else:  # stored [1, 1, heads, 1]: bf16 is tolerated, a flat vector is not
        long_a_log = (specs[prefix + a_logs[0]][0], torch.bfloat16)
        bad_a_log = ((cfg.kda_num_heads,), torch.float32)
        a_log_rule = "a_log_bf16"
    edits = {router: (specs[prefix + router][0], torch.float32), a_logs[0]: long_a_log, a_logs[1]: bad_a_log,
             norm: (specs[prefix + norm][0], torch.float32), bias: (specs[prefix + bias][0], torch.bfloat16)}
    edited = dict(specs) | {prefix + n: s for n, s in edits.items()}
    edited_names = {prefix + n for n in edits}
    already = {(t.checkpoint_name, t.rule) for t in reconcile_checkpoint(ctx.checkpoint_dir, cfg=cfg).tolerated
               if t.checkpoint_name not in edited_names}  # what the checkpoint itself carries under a rule
    tolerated = already | {(prefix + router, "keep_in_fp32"), (prefix + a_logs[0], a_log_rule)}
    mismatched = {(prefix + a_logs[1], "shape"), (prefix + norm, "dtype"), (prefix + bias, "dtype")}

    def flags(res: ReconcileResult) -> torch.Tensor:
        found = {(t.checkpoint_name, t.rule) for t in res.tolerated}
        bad = {(m.checkpoint_name, m.kind) for m in res.mismatched}
        detail_ok = not cfg.is_k3 or any("padding value(s)" in t.detail for t in res.tolerated
                                         if t.checkpoint_name == prefix + a_logs[0])
        return torch.tensor([int(found == tolerated), int(bad == mismatched), int(detail_ok),
                             int(not (res.no_source or res.partial or res.no_destination)),
                             int(res.num_matched == res.num_expected - len(mismatched))])

    with tempfile.TemporaryDirectory(prefix="k3v-tolerances-") as tmp:
        copy = Path(tmp) / "edited"
        write_sparse_checkpoint(json.loads((ctx.checkpoint_dir / "config.json").read_text()), edited, copy,
                                shard_max_bytes=SYNTHETIC_SHARD_MAX_BYTES, generation_config=None)
        cand = reconcile_checkpoint(copy, cfg=cfg)
        with _rules_off():
            ctrl = reconcile_checkpoint(copy, cfg=cfg)
    labels = ["tolerated_exactly", "mismatched_exactly", "padding_reported", "no_other_bucket", "matched_count"]
    return Trial(reference=torch.ones(len(labels), dtype=torch.int64), candidate=flags(cand), control=flags(ctrl),
                 notes=[f"flags: {labels}", f"edits (name: shape, dtype): {edits}",
                        f"tolerated: {[(t.checkpoint_name, t.rule, t.detail) for t in cand.tolerated]}",
                        f"mismatched: {[(m.checkpoint_name, m.kind) for m in cand.mismatched]}"])


def _tolerated_mapping(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], a_log: str) -> dict[str, torch.Tensor]:
    """The checkpoint with every router in fp32 and one A_log as a real writer may store it."""
    prefix = cfg.checkpoint_prefix
    out = dict(tensors)
    for name in [n for n in out if n.endswith("block_sparse_moe.gate.weight")]:
        out[name] = out[name].float()
    value = tensors[prefix + a_log]
    if cfg.is_k3:
        padded = torch.full((_long_a_log(cfg),), PAD_VALUE)
        padded[:cfg.kda_num_heads] = value[:cfg.kda_num_heads]
        out[prefix + a_log] = padded
    else:
        out[prefix + a_log] = value.to(torch.bfloat16)
    return out


def _expected_holding(stored: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The rule by hand: leading entries of a re-padded A_log, NaN past them; everything else cast."""
    if tuple(stored.shape) == shape:
        return stored.to(dtype)
    out = torch.full(shape, float("nan"), dtype=dtype)
    n = min(shape[0], stored.numel())
    out[:n] = stored[:n].to(dtype)
    return out


Load = Callable[[nn.Module, ModelConfig, Mapping[str, torch.Tensor]], None]


def _rule_free_load(module: nn.Module, cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> None:
    """Control: a loader that refuses any stored dtype other than the spec's and knows no shape rule."""
    for name, spec in module_specs(cfg).items():
        stored = cfg.checkpoint_prefix + name
        if stored in tensors and tensors[stored].dtype != spec.dtype:
            raise WeightLoadError(f"{stored}: dtype {tensors[stored].dtype} is not the spec's {spec.dtype}")
    with _rules_off():
        load_into(module, cfg, tensors)


@register_check(id="weights.loader.tolerances", component="weights", level="module", kind=Kind.BITEXACT,
                control="a loader without the rules: it refuses the fp32 router and the re-padded A_log")
def check_loader_tolerances(ctx: CheckContext) -> Trial:
    builders.require_whole_model(ctx, "a host copy of the checkpoint", torch.bfloat16)
    cfg, prefix = ctx.cfg, ctx.cfg.checkpoint_prefix
    # the tolerated load and the refused one are separate mappings: one KDA layer (a real-size slice's) serves both
    router, (a_log,), _, _ = _targets(cfg, 1)
    specs = module_specs(cfg)
    mapping = _tolerated_mapping(cfg, builders.checkpoint_tensors(ctx), a_log)
    short = dict(mapping)
    short[prefix + a_log] = torch.zeros(cfg.kda_num_heads - 1)
    names = [router, a_log]
    reference = {n: _expected_holding(mapping[prefix + n], specs[n].shape, specs[n].dtype) for n in names}

    def run(load: Load) -> dict[str, torch.Tensor]:
        module = build_param_module(specs, device="cpu")
        got = {n: torch.full(specs[n].shape, -1.0, dtype=specs[n].dtype) for n in names}
        flags = [0, 0]
        try:
            load(module, cfg, mapping)
            state = module.state_dict()
            got = {n: state[n].clone() for n in names}
            flags[0] = 1
        except WeightLoadError:
            pass
        try:
            load(build_param_module(specs, device="meta"), cfg, short)
        except WeightLoadError as exc:
            flags[1] = int(a_log in str(exc) and (not cfg.is_k3 or "KDA heads" in str(exc)))
        return {**got, "outcomes": torch.tensor(flags)}

    return Trial(reference={**reference, "outcomes": torch.ones(2, dtype=torch.int64)}, candidate=run(load_into),
                 control=run(_rule_free_load),
                 notes=[f"routers stored fp32, {a_log} stored {tuple(mapping[prefix + a_log].shape)} "
                        f"{mapping[prefix + a_log].dtype}; outcomes: [tolerated load, A_log of "
                        f"{cfg.kda_num_heads - 1} entries refused naming it]"])
