"""Reconcile a checkpoint with the tensors a model expects, through the one name map, in four buckets.

(a) no_source       a model parameter nothing in the checkpoint fills;
(b) partial         a declared slot whose host source is incomplete: a quantized expert weight with
                    `weight_packed` but no `weight_scale` (or the reverse);
(c) no_destination  a checkpoint tensor no parameter takes (declared ignorables are listed apart,
                    each with its reason);
(d) mismatched      a source whose shape or dtype differs from its parameter, unless a named rule of
                    checkpoint/tolerances.py accepts it: then it is matched and listed under `tolerated`
                    with the rule (an A_log's padding values are read and reported).

Default mode reads the index and every shard header (no tensor data). `index_only=True` reads the
index json alone: it sees names, so (a)-(c) work, but it has no shapes or dtypes, so it CANNOT see
a transposed or re-typed tensor ((d) is always empty there).

The expected tensors default to `names.module_specs(cfg)` with the checkpoint dtypes; any list of
(name, shape, dtype) can be passed instead, e.g. a serving model's parameters built on the meta
device (`expected_from_module`); dtype None accepts any dtype (the loader casts). `hf_names=True` reads a
directory written by transformers (checkpoint/hf_interop.py): its spellings are mapped to ours first, fused
tensors by the shape of their slice; names the map cannot place stay as they are and land in (c).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from k3verify.checkpoint import mxfp4
from k3verify.checkpoint.hf_interop import partial_name_plan, source_shape
from k3verify.checkpoint.names import TensorSpec, ignorable_reason, module_specs, to_module_name
from k3verify.checkpoint.reader import CheckpointError, CheckpointReader, read_index
from k3verify.checkpoint.tolerances import A_LOG_PADDING, a_log_padding_detail, dtype_rule, shape_rule
from k3verify.checkpoint.writer import TORCH_DTYPES, gc_paused
from k3verify.config import ModelConfig

_DENSE_EXPERT = re.compile(r"^(.*\.experts\.\d+\.w[123])\.weight$")
_PACKED_PART = re.compile(r"^(.*\.experts\.\d+\.w[123])\.(weight_packed|weight_scale)$")
_PARTNER = {"weight_packed": "weight_scale", "weight_scale": "weight_packed"}


class ExpectedTensor(NamedTuple):  # NamedTuples: K3 has ~500k of each
    name: str  # module parameter name (checkpoint naming without K3's prefix)
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: any dtype is accepted (the loader casts)


class FoundTensor(NamedTuple):
    """A checkpoint tensor as the index (shape/dtype None) or a shard header describes it."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None


@dataclass(frozen=True)
class PartialSlot:
    slot: str  # module slot, e.g. model.layers.1.block_sparse_moe.experts.3.w1
    present: str  # checkpoint name found
    missing: str  # checkpoint name absent


@dataclass(frozen=True)
class Unplaced:
    name: str
    reason: str


@dataclass(frozen=True)
class Mismatch:
    checkpoint_name: str
    module_name: str
    found_shape: tuple[int, ...]
    expected_shape: tuple[int, ...]
    found_dtype: str
    expected_dtype: str
    accepted: str = ""  # "shape" or "dtype" when a named rule accepted that half (the other half is wrong)

    @property
    def kind(self) -> str:
        parts = [k for k, bad in (("shape", self.found_shape != self.expected_shape),
                                  ("dtype", self.found_dtype != self.expected_dtype)) if bad and k != self.accepted]
        return "+".join(parts)


@dataclass(frozen=True)
class Tolerated:
    checkpoint_name: str
    module_name: str
    rule: str  # a tolerances.RULES id
    detail: str


@dataclass
class ReconcileResult:
    checkpoint: str
    mode: str  # "headers" | "index-only"
    num_checkpoint_tensors: int
    num_expected: int
    num_matched: int = 0
    no_source: list[str] = field(default_factory=list)  # (a)
    partial: list[PartialSlot] = field(default_factory=list)  # (b)
    no_destination: list[Unplaced] = field(default_factory=list)  # (c)
    mismatched: list[Mismatch] = field(default_factory=list)  # (d)
    ignored: list[Unplaced] = field(default_factory=list)  # declared ignorable, with the reason
    tolerated: list[Tolerated] = field(default_factory=list)  # matched under a named rule (tolerances.py)
    names: str = "published"  # "published" | "transformers" (mapped through hf_interop)

    def rules_used(self) -> dict[str, int]:
        """{rule id: tensors it accepted}, in rule order of first use."""
        counts: dict[str, int] = {}
        for t in self.tolerated:
            counts[t.rule] = counts.get(t.rule, 0) + 1
        return counts

    @property
    def ok(self) -> bool:
        return not (self.no_source or self.partial or self.no_destination or self.mismatched)

    def buckets(self) -> dict[str, list[Any]]:
        return {"a_no_source": self.no_source, "b_partial": self.partial, "c_no_destination": self.no_destination,
                "d_mismatched": self.mismatched}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["counts"] = {k: len(v) for k, v in self.buckets().items()} | {"ignored": len(self.ignored),
                                                                            "tolerated": len(self.tolerated)}
        data["rules_used"] = self.rules_used()
        return data


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "any" if dtype is None else str(dtype).removeprefix("torch.")


def expected_from_specs(specs: Mapping[str, TensorSpec]) -> list[ExpectedTensor]:
    return [ExpectedTensor(name, tuple(spec.shape), spec.dtype) for name, spec in specs.items()]


def expected_from_module(module: nn.Module, *, exact_dtype: bool = True) -> list[ExpectedTensor]:
    """A (meta-device) module's parameters and buffers as expected tensors."""
    return [ExpectedTensor(name, tuple(t.shape), t.dtype if exact_dtype else None)
            for name, t in module.state_dict(keep_vars=True).items()]


def build_param_module(specs: Mapping[str, TensorSpec] | Iterable[ExpectedTensor],
                       device: str | torch.device = "meta") -> nn.Module:
    """A plain module whose state_dict keys are exactly the spec names (dots become submodules)."""
    items = ([(e.name, e.shape, e.dtype or torch.float32) for e in specs] if not isinstance(specs, Mapping)
             else [(n, s.shape, s.dtype) for n, s in specs.items()])
    root = nn.Module()
    for name, shape, dtype in items:
        *path, leaf = name.split(".")
        node = root
        for part in path:
            child = node._modules.get(part)
            if child is None:
                child = nn.Module()
                node.add_module(part, child)
            node = child
        node.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                                   requires_grad=False))
    return root


Reader = Callable[[str], torch.Tensor]  # checkpoint name -> tensor (headers mode: to report A_log padding)


def reconcile_entries(cfg: ModelConfig, found: Mapping[str, FoundTensor], expected: Sequence[ExpectedTensor], *,
                      checkpoint: str = "", mode: str = "headers", read: Reader | None = None) -> ReconcileResult:
    """Sort every expected tensor and every checkpoint tensor into matched or one of the four buckets."""
    result = ReconcileResult(checkpoint=checkpoint, mode=mode, num_checkpoint_tensors=len(found),
                             num_expected=len(expected))
    by_module: dict[str, str] = {}
    for name in found:
        reason = ignorable_reason(name)
        if reason is not None:
            result.ignored.append(Unplaced(name, reason))
            continue
        try:
            module = to_module_name(cfg, name)
        except KeyError as exc:
            result.no_destination.append(Unplaced(name, str(exc.args[0])))
            continue
        assert module is not None, f"{name!r}: to_module_name is None only for ignorable names, sorted out above"
        by_module[module] = name
    group = cfg.quant.group_size if cfg.quant is not None else mxfp4.GROUP
    match = _Matcher(cfg, result, read)
    used: set[str] = set()
    for exp in expected:
        src = by_module.get(exp.name)
        if src is not None:
            used.add(src)
            if match.check(found[src], src, exp.name, exp.shape, exp.dtype):
                result.num_matched += 1
            continue
        dense = _DENSE_EXPERT.match(exp.name)
        if dense:
            _match_pair(match, found, by_module, used, dense.group(1), exp, group)
            continue
        part = _PACKED_PART.match(exp.name)
        partner = by_module.get(f"{part.group(1)}.{_PARTNER[part.group(2)]}") if part else None
        if part and partner is not None:
            result.partial.append(PartialSlot(part.group(1), partner, _ckpt_name(cfg, exp.name)))
        else:
            result.no_source.append(exp.name)
    for mod, src in by_module.items():
        if src not in used:
            result.no_destination.append(Unplaced(src, f"no model parameter {mod!r}"))
    result.no_destination.sort(key=lambda u: u.name)
    return result


def _ckpt_name(cfg: ModelConfig, module_name: str) -> str:
    return cfg.checkpoint_prefix + module_name


@dataclass
class _Matcher:
    cfg: ModelConfig
    result: ReconcileResult
    read: Reader | None

    def check(self, got: FoundTensor, src: str, mod: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> bool:
        """Record a (d) mismatch if the header disagrees and no named rule accepts it; True when it matches
        (or cannot be seen). A rule's acceptance is recorded under `tolerated`."""
        bad_shape = got.shape is not None and tuple(got.shape) != tuple(shape)
        bad_dtype = got.dtype is not None and dtype is not None and got.dtype != dtype
        shape_ok = self._shape_rule(got, src, mod, shape) if bad_shape else True
        dtype_ok = self._dtype_rule(got, src, mod, dtype) if bad_dtype else True
        if shape_ok and dtype_ok:
            return True
        accepted = "shape" if bad_shape and shape_ok else "dtype" if bad_dtype and dtype_ok else ""
        if accepted:  # the rule's acceptance does not stand for a tensor that is wrong otherwise
            self.result.tolerated.pop()
        self.result.mismatched.append(Mismatch(src, mod, got.shape or shape, tuple(shape),
                                               _dtype_name(got.dtype or dtype), _dtype_name(dtype), accepted))
        return False

    def _shape_rule(self, got: FoundTensor, src: str, mod: str, shape: tuple[int, ...]) -> bool:
        assert got.shape is not None
        rule = shape_rule(self.cfg, mod, tuple(got.shape), tuple(shape))
        if rule is None:
            return False
        detail = f"stored {list(got.shape)}, module {list(shape)}"
        if rule is A_LOG_PADDING and self.read is not None:
            detail = a_log_padding_detail(self.cfg, self.read(src))
        self.result.tolerated.append(Tolerated(src, mod, rule.id, detail))
        return True

    def _dtype_rule(self, got: FoundTensor, src: str, mod: str, dtype: torch.dtype | None) -> bool:
        assert got.dtype is not None and dtype is not None
        rule = dtype_rule(mod, got.dtype, dtype)
        if rule is not None:
            self.result.tolerated.append(Tolerated(src, mod, rule.id,
                                                   f"stored {_dtype_name(got.dtype)}, spec {_dtype_name(dtype)}"))
        return rule is not None


def _match_pair(match: _Matcher, found: Mapping[str, FoundTensor], by_module: dict[str, str], used: set[str],
                slot: str, exp: ExpectedTensor, group: int) -> None:
    """A dense expert parameter filled by dequantizing `slot.weight_packed` + `slot.weight_scale`."""
    result = match.result
    packed, scale = by_module.get(f"{slot}.weight_packed"), by_module.get(f"{slot}.weight_scale")
    if packed is None or scale is None:
        if packed is not None:
            present, missing = packed, f"{slot}.weight_scale"
        elif scale is not None:
            present, missing = scale, f"{slot}.weight_packed"
        else:
            result.no_source.append(exp.name)
            return
        used.add(present)
        result.partial.append(PartialSlot(slot, present, match.cfg.checkpoint_prefix + missing))
        return
    used.update((packed, scale))
    rows, cols = exp.shape
    ok_packed = match.check(found[packed], packed, f"{slot}.weight_packed", (rows, cols // 2), torch.uint8)
    ok_scale = match.check(found[scale], scale, f"{slot}.weight_scale", (rows, cols // group), torch.uint8)
    if ok_packed and ok_scale:
        result.num_matched += 1


def found_from_reader(reader: CheckpointReader) -> dict[str, FoundTensor]:
    dtypes = TORCH_DTYPES
    return {name: FoundTensor(e.shape, dtypes[e.dtype]) for name, e in reader.entries.items()}


def reconcile_checkpoint(ckpt_dir: str | Path, *, index_only: bool = False, cfg: ModelConfig | None = None,
                         expected: Sequence[ExpectedTensor] | None = None, hf_names: bool = False) -> ReconcileResult:
    """Reconcile a checkpoint dir with `expected` (default: module_specs of its own config.json)."""
    with gc_paused():
        return _reconcile_checkpoint(Path(ckpt_dir), index_only, cfg, expected, hf_names)


def _reconcile_checkpoint(ckpt_dir: Path, index_only: bool, cfg: ModelConfig | None,
                          expected: Sequence[ExpectedTensor] | None, hf_names: bool) -> ReconcileResult:
    cfg = cfg if cfg is not None else ModelConfig.from_file(ckpt_dir)
    expected = expected if expected is not None else expected_from_specs(module_specs(cfg))
    reader: CheckpointReader | None = None
    if index_only:
        found = {name: FoundTensor(None, None) for name in read_index(ckpt_dir).weight_map}
    else:
        reader = CheckpointReader(ckpt_dir)
        found = found_from_reader(reader)
    read: Reader | None = reader.__getitem__ if reader is not None else None
    if hf_names:
        found, read = _through_hf_names(cfg, found, read)
    result = reconcile_entries(cfg, found, expected, checkpoint=str(ckpt_dir),
                               mode="index-only" if index_only else "headers", read=read)
    result.names = "transformers" if hf_names else "published"
    return result


def _through_hf_names(cfg: ModelConfig, found: Mapping[str, FoundTensor],
                      read: Reader | None) -> tuple[dict[str, FoundTensor], Reader | None]:
    """`found` under our names (transformers' spellings mapped, fused tensors as their slices); names the
    map cannot place are kept as they are, so the buckets name them. Two sources for one name raise."""
    plan, leftover, collisions = partial_name_plan(cfg, found)
    if collisions:
        raise CheckpointError(f"--hf-names: {len(collisions)} tensor(s) have two sources: {collisions[:4]}")
    out: dict[str, FoundTensor] = {}
    for ours, source in plan.items():
        got = found[source.name]
        out[ours] = FoundTensor(None if got.shape is None else source_shape(got.shape, source), got.dtype)
    out.update((name, found[name]) for name in leftover)
    if read is None:
        return out, None
    base = read

    def read_ours(name: str) -> torch.Tensor:
        source = plan[name] if name in plan else None
        if source is None:
            return base(name)
        value = base(source.name)
        return value if source.index is None else value[source.index]

    return out, read_ours
