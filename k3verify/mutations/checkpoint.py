"""Checkpoint faults: the MXFP4 codec used by the loader, the strict loader, the reconciler and the config."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

CODEC = "k3verify.checkpoint.mxfp4"

MUTANTS = [
    Mutant(
        id="checkpoint.mxfp4.high_nibble_first", quick=True,
        fault="the checkpoint MXFP4 decoder reads the high nibble of each byte as the earlier element",
        target=f"{CODEC}:decode_codes",
        old="return torch.stack((low, high), dim=-1)",
        new="return torch.stack((high, low), dim=-1)",
        killers=["oracle.mxfp4.*"],
    ),
    Mutant(
        id="checkpoint.mxfp4.e8m0_bias_128",
        fault="the checkpoint MXFP4 decoder uses an E8M0 bias of 128 instead of 127",
        target=f"{CODEC}:dequantize",
        old="exps = scale.to(torch.int32) - 127",
        new="exps = scale.to(torch.int32) - 128",
        killers=["oracle.mxfp4.*"],
    ),
    Mutant(
        id="checkpoint.loader.skips_unknown_names", quick=True,
        fault="the loader silently skips checkpoint tensors that have no destination instead of refusing",
        target="k3verify.checkpoint.loader:plan_sources",
        old="if missing or unexpected:",
        new="if missing:",
        killers=["weights.loader.strict"],
    ),
    Mutant(
        id="checkpoint.loader.skips_missing",
        fault="the loader leaves module tensors without a checkpoint source at their init values",
        target="k3verify.checkpoint.loader:plan_sources",
        old="if missing or unexpected:",
        new="if unexpected:",
        killers=["weights.loader.strict"],
    ),
    Mutant(
        id="checkpoint.reconcile.ignores_shape_mismatch",
        fault="the reconciler matches a tensor whose header shape differs from its parameter",
        target="k3verify.checkpoint.buckets:_Matcher.check",
        old="bad_shape = got.shape is not None and tuple(got.shape) != tuple(shape)",
        new="bad_shape = False",
        killers=["weights.reconcile.buckets"],
    ),
    Mutant(
        id="checkpoint.tolerance.fp32_for_any_name",
        fault="the keep_in_fp32 rule accepts fp32 for every tensor, not only the router weight and the two biases",
        target="k3verify.checkpoint.tolerances:dtype_rule",
        old="if found == torch.float32 and expected in _NARROW_FLOATS and KEEP_IN_FP32.applies_to.search(name):",
        new="if found == torch.float32 and expected in _NARROW_FLOATS:",
        killers=["weights.reconcile.tolerances"],
    ),
    Mutant(
        id="checkpoint.tolerance.a_log_any_length",
        fault="the a_log_padding rule also accepts an A_log shorter than the KDA head count",
        target="k3verify.checkpoint.tolerances:shape_rule",
        old="return A_LOG_PADDING if found[0] >= cfg.kda_num_heads else None",
        new="return A_LOG_PADDING",
        killers=["weights.reconcile.tolerances"],
    ),
    Mutant(
        id="checkpoint.tolerance.a_log_tail", quick=True,
        fault="a re-padded A_log is read from its tail (the padding) instead of its first `heads` entries",
        target="k3verify.checkpoint.tolerances:fit_a_log",
        old="out[:n] = value[:n].float()",
        new="out[:n] = value[-n:].float()",
        killers=["weights.loader.tolerances"],
    ),
    Mutant(
        id="config.generation_eos_dropped",
        fault="the config keeps only config.json's eos id and drops generation_config.json's (163585 vs 163586)",
        target="k3verify.config_json:_parse_text",
        old="eos_ids = eos_ids + tuple(e for e in generation_eos if e not in eos_ids)",
        new="eos_ids = eos_ids",
        killers=["serving.*"],
    ),
]
