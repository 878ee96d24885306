"""Reconcile a checkpoint with the tensors a model expects, through the one name map, in four buckets.

(a) no_source       a model parameter nothing in the checkpoint fills;
(b) partial         a declared slot whose host source is incomplete: a quantized expert weight with
                    `weight_packed` but no `weight_scale` (or the reverse);
(c) no_destination  a checkpoint tensor no parameter takes (declared ignorables are listed apart,
                    each with its reason);
(d) mismatched      a source whose shape or dtype differs from its parameter.

Default mode reads the index and every shard header (no tensor data). `index_only=True` reads the
index json alone: it sees names, so (a)-(c) work, but it has no shapes or dtypes, so it CANNOT see
a transposed or re-typed tensor ((d) is always empty there).

The expected tensors default to `names.module_specs(cfg)` with the checkpoint dtypes; any list of
(name, shape, dtype) can be passed instead, e.g. a serving model's parameters built on the meta
device (`expected_from_module`); dtype None accepts any dtype (the loader casts).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from k3verify.checkpoint import mxfp4
from k3verify.checkpoint.names import TensorSpec, ignorable_reason, module_specs, to_module_name
from k3verify.checkpoint.reader import CheckpointReader, read_index
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

    @property
    def kind(self) -> str:
        parts = [k for k, bad in (("shape", self.found_shape != self.expected_shape),
                                  ("dtype", self.found_dtype != self.expected_dtype)) if bad]
        return "+".join(parts)


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

    @property
    def ok(self) -> bool:
        return not (self.no_source or self.partial or self.no_destination or self.mismatched)

    def buckets(self) -> dict[str, list[Any]]:
        return {"a_no_source": self.no_source, "b_partial": self.partial, "c_no_destination": self.no_destination,
                "d_mismatched": self.mismatched}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["counts"] = {k: len(v) for k, v in self.buckets().items()} | {"ignored": len(self.ignored)}
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


def reconcile_entries(cfg: ModelConfig, found: Mapping[str, FoundTensor], expected: Sequence[ExpectedTensor], *,
                      checkpoint: str = "", mode: str = "headers") -> ReconcileResult:
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
            by_module[to_module_name(cfg, name)] = name  # type: ignore[index]
        except KeyError as exc:
            result.no_destination.append(Unplaced(name, str(exc.args[0])))
    group = cfg.quant.group_size if cfg.quant is not None else mxfp4.GROUP
    used: set[str] = set()
    for exp in expected:
        src = by_module.get(exp.name)
        if src is not None:
            used.add(src)
            if _check(result, found[src], src, exp.name, exp.shape, exp.dtype):
                result.num_matched += 1
            continue
        dense = _DENSE_EXPERT.match(exp.name)
        if dense:
            _match_pair(result, found, by_module, used, dense.group(1), exp, group, cfg.checkpoint_prefix)
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


def _check(result: ReconcileResult, got: FoundTensor, src: str, mod: str, shape: tuple[int, ...],
           dtype: torch.dtype | None) -> bool:
    """Record a (d) mismatch if the header disagrees; True when it matches (or cannot be seen)."""
    bad_shape = got.shape is not None and tuple(got.shape) != tuple(shape)
    bad_dtype = got.dtype is not None and dtype is not None and got.dtype != dtype
    if bad_shape or bad_dtype:
        result.mismatched.append(Mismatch(src, mod, got.shape or shape, tuple(shape),
                                          _dtype_name(got.dtype or dtype), _dtype_name(dtype)))
        return False
    return True


def _match_pair(result: ReconcileResult, found: Mapping[str, FoundTensor], by_module: dict[str, str], used: set[str],
                slot: str, exp: ExpectedTensor, group: int, prefix: str) -> None:
    """A dense expert parameter filled by dequantizing `slot.weight_packed` + `slot.weight_scale`."""
    packed, scale = by_module.get(f"{slot}.weight_packed"), by_module.get(f"{slot}.weight_scale")
    if packed is None and scale is None:
        result.no_source.append(exp.name)
        return
    if packed is None or scale is None:
        present = packed or scale
        used.add(present)  # type: ignore[arg-type]
        missing = prefix + (f"{slot}.weight_scale" if scale is None else f"{slot}.weight_packed")
        result.partial.append(PartialSlot(slot, present, missing))  # type: ignore[arg-type]
        return
    used.update((packed, scale))
    rows, cols = exp.shape
    ok_packed = _check(result, found[packed], packed, f"{slot}.weight_packed", (rows, cols // 2), torch.uint8)
    ok_scale = _check(result, found[scale], scale, f"{slot}.weight_scale", (rows, cols // group), torch.uint8)
    if ok_packed and ok_scale:
        result.num_matched += 1


def found_from_reader(reader: CheckpointReader) -> dict[str, FoundTensor]:
    dtypes = TORCH_DTYPES
    return {name: FoundTensor(e.shape, dtypes[e.dtype]) for name, e in reader.entries.items()}


def reconcile_checkpoint(ckpt_dir: str | Path, *, index_only: bool = False, cfg: ModelConfig | None = None,
                         expected: Sequence[ExpectedTensor] | None = None) -> ReconcileResult:
    """Reconcile a checkpoint dir with `expected` (default: module_specs of its own config.json)."""
    with gc_paused():
        return _reconcile_checkpoint(Path(ckpt_dir), index_only, cfg, expected)


def _reconcile_checkpoint(ckpt_dir: Path, index_only: bool, cfg: ModelConfig | None,
                          expected: Sequence[ExpectedTensor] | None) -> ReconcileResult:
    cfg = cfg if cfg is not None else ModelConfig.from_file(ckpt_dir)
    expected = expected if expected is not None else expected_from_specs(module_specs(cfg))
    if index_only:
        found = {name: FoundTensor(None, None) for name in read_index(ckpt_dir).weight_map}
    else:
        found = found_from_reader(CheckpointReader(ckpt_dir))
    return reconcile_entries(cfg, found, expected, checkpoint=str(ckpt_dir),
                             mode="index-only" if index_only else "headers")
