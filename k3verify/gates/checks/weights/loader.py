"""Checkpoint loading and reconciliation: the strict loader and the four reconcile buckets.

`weights.loader.strict` loads the run's checkpoint into a module whose parameters are exactly the text model's
checkpoint tensors (names.module_specs), compares every loaded byte with the checkpoint read independently
(safetensors' own loader, shard by shard), and records whether the loader refuses a mapping with a tensor removed
or an unknown tensor added. `weights.reconcile.buckets` writes an edited, header-only copy of the checkpoint (a
dropped tensor, half of an MXFP4 pair dropped, a transposed non-square tensor, a re-typed tensor, unknown
tensors) and records whether each edit lands in its bucket (gates/checks/weights/reconcile.py). Outcomes are 0/1
flags; the reference is all ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from k3verify.checkpoint.buckets import build_param_module
from k3verify.checkpoint.hf_interop import normalize_hf_names
from k3verify.checkpoint.loader import WeightLoadError, load_into
from k3verify.checkpoint.names import TensorSpec, module_specs, quantized_pair
from k3verify.gates import CheckContext, Kind, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.checkpoint_edits import DROPPED, UNKNOWN_IN_PREFIX, UNKNOWN_OUTSIDE
from k3verify.gates.shared.slice import SlicedTarget, SlicedTensors


class _EditedTensors(Mapping[str, torch.Tensor]):
    """`base` with some names removed and some added; no tensor data is read until a name is looked up."""

    def __init__(self, base: Mapping[str, torch.Tensor], *, drop: Collection[str] = (),
                 extra: Mapping[str, torch.Tensor] | None = None) -> None:
        self._base = base
        self._drop = frozenset(drop)
        self._extra = dict(extra or {})
        self._names = [n for n in base if n not in self._drop] + [n for n in self._extra if n not in base]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._extra:
            return self._extra[name]
        if name in self._drop:
            raise KeyError(name)
        return self._base[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


Loader = Callable[[nn.Module, Mapping[str, torch.Tensor]], None]


class _IndependentRead(Mapping[str, torch.Tensor]):
    """A checkpoint dir's tensors through safetensors' own reader (not k3verify's), each read when asked for (a
    slice of a real-size checkpoint reads its own layers only)."""

    def __init__(self, ckpt_dir: Path) -> None:
        from safetensors import safe_open

        index = ckpt_dir / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
            ["model.safetensors"]
        self.handles = [safe_open(str(ckpt_dir / file), framework="pt") for file in files]
        self.where = {name: h for h in self.handles for name in h.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def _as_module_holds(name: str, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The stored value as the module must hold it. The one allowed reshaping is rule a_log_padding (stated
    here independently of the loader): a 1-D A_log of another length keeps its leading entries, NaN past them."""
    if tuple(value.shape) == tuple(shape) or not name.endswith(".A_log"):
        return value
    out = torch.full(shape, float("nan"), dtype=torch.float32)
    n = min(shape[0], value.numel())
    out[:n] = value.reshape(-1)[:n].float()
    return out


class _ByteLayout:
    """Every module tensor's bytes in spec order in one uint8 buffer, each at an offset aligned to 8 bytes (the
    gaps are zero). The loaded module's parameters are views into such a buffer, so the loaded bytes are the
    buffer itself: at real size a slice's byte image is gigabytes, and a copy of it per comparand is what a host
    runs out of."""

    def __init__(self, specs: Mapping[str, TensorSpec]) -> None:
        self.specs = specs
        self.spans: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, spec in specs.items():
            size = math.prod(spec.shape) * torch.empty((), dtype=spec.dtype).element_size()
            self.spans[name] = (offset, size)
            offset += -(-size // 8) * 8
        self.total = offset
        self.data_bytes = sum(size for _, size in self.spans.values())

    def words(self, buffer: torch.Tensor) -> torch.Tensor:
        """The buffer as 8-byte words (its length is a multiple of 8): compared word by word, a byte that differs
        still fails, and the comparison's mask is an eighth of the bytes'."""
        return buffer.view(torch.int64)

    def buffer(self) -> torch.Tensor:
        return torch.zeros(self.total, dtype=torch.uint8)

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        offset, size = self.spans[name]
        spec = self.specs[name]
        return buffer[offset:offset + size].view(spec.dtype).view(spec.shape)

    def module(self, buffer: torch.Tensor) -> nn.Module:
        """build_param_module(specs)'s names, every parameter a view into `buffer`."""
        module = build_param_module(self.specs, device="meta")
        for name in self.specs:
            *path, leaf = name.split(".")
            module.get_submodule(".".join(path)).register_parameter(
                leaf, nn.Parameter(self.view(buffer, name), requires_grad=False))
        return module


@torch.no_grad()
def _sentinel_fill(module: nn.Module) -> None:
    """Fill every parameter with a value no loaded tensor is made of, so a skipped copy cannot pass."""
    for t in module.state_dict(keep_vars=True).values():
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.fill_(0xA5)


def _outcome(load: Loader, module: nn.Module, tensors: Mapping[str, torch.Tensor], must_name: str | None,
             notes: list[str], label: str) -> int:
    """1 when the load behaves: no error for a clean mapping (must_name None), else WeightLoadError naming it."""

    try:
        load(module, tensors)
    except WeightLoadError as exc:
        if must_name is None:
            notes.append(f"{label}: clean load refused: {exc}")
            return 0
        if must_name not in str(exc):
            notes.append(f"{label}: refused without naming {must_name!r}: {exc}")
            return 0
        return 1
    except Exception as exc:  # a crash instead of the loader's own error is a failure, recorded
        notes.append(f"{label}: {type(exc).__name__}: {exc}")
        return 0
    if must_name is not None:
        notes.append(f"{label}: accepted")
        return 0
    return 1


Scenario = tuple[str, Mapping[str, torch.Tensor], str | None]  # label, mapping, name a refusal must mention


def _load_scenarios(tensors: Mapping[str, torch.Tensor], prefix: str, half: str | None) -> list[Scenario]:
    """The clean checkpoint (must load; must_name None), then one edit per refusal the loader owes."""
    extra_value = torch.zeros(4, 4, dtype=torch.bfloat16)
    scenarios: list[Scenario] = [
        ("clean", tensors, None),
        (f"missing:{DROPPED}", _EditedTensors(tensors, drop=[prefix + DROPPED]), DROPPED),
    ]
    if half is not None:
        scenarios.append((f"missing_half_pair:{half}", _EditedTensors(tensors, drop=[prefix + half]), half))
    scenarios.append((f"unknown:{prefix + UNKNOWN_IN_PREFIX}",
                      _EditedTensors(tensors, extra={prefix + UNKNOWN_IN_PREFIX: extra_value}),
                      prefix + UNKNOWN_IN_PREFIX))
    if prefix:
        scenarios.append((f"unknown_outside_prefix:{UNKNOWN_OUTSIDE}",
                          _EditedTensors(tensors, extra={UNKNOWN_OUTSIDE: extra_value}), UNKNOWN_OUTSIDE))
    return scenarios


@torch.no_grad()
def _lenient_load(module: nn.Module, mapping: Mapping[str, torch.Tensor], prefix: str) -> None:
    """The control's loader: copies whatever names match, skips missing and unknown tensors."""
    state = module.state_dict(keep_vars=True)
    for name in mapping:
        mod = name[len(prefix):] if name.startswith(prefix) else None
        if mod in state and not state[mod].is_meta:  # a copy onto meta is a no-op: skip the read
            state[mod].copy_(mapping[name].to(device=state[mod].device, dtype=state[mod].dtype))


@register_check(
    id="weights.loader.strict", component="weights", level="module", kind=Kind.BITEXACT,
    control="a lenient loader that copies whatever names match and skips missing and unknown tensors",
)
def check_loader_strict(ctx: CheckContext) -> Trial:

    builders.require_whole_model(ctx, "two host copies of the checkpoint", torch.bfloat16)
    cfg = ctx.cfg
    prefix: str = cfg.checkpoint_prefix
    specs = module_specs(cfg)
    tensors = builders.checkpoint_tensors(ctx)
    half = next((n for n in specs if quantized_pair(n) is not None and n.endswith(".weight_scale")), None)
    scenarios = _load_scenarios(tensors, prefix, half)

    def strict(module: nn.Module, mapping: Mapping[str, torch.Tensor]) -> None:
        load_into(module, cfg, mapping)

    def lenient(module: nn.Module, mapping: Mapping[str, torch.Tensor]) -> None:
        _lenient_load(module, mapping, prefix)

    layout = _ByteLayout(specs)
    loaded = layout.buffer()
    host = layout.module(loaded)  # re-filled with sentinels before each clean load; its bytes are `loaded`
    meta = build_param_module(specs, device="meta")  # for refusals only the outcome matters, not the values

    def run(load: Loader, notes: list[str]) -> torch.Tensor:
        flags: list[int] = []
        for label, mapping, must_name in scenarios:
            module = meta if must_name is not None else host
            if must_name is None:
                _sentinel_fill(module)
            flags.append(_outcome(load, module, mapping, must_name, notes, label))
        return torch.tensor(flags, dtype=torch.int64)

    cand_notes: list[str] = []
    ctrl_notes: list[str] = []
    cand_flags = run(strict, cand_notes)
    cand_bytes = loaded.clone()  # the control's load overwrites `loaded` next
    ctrl_flags = run(lenient, ctrl_notes)
    ctrl_bytes = loaded
    source: Mapping[str, torch.Tensor] = _IndependentRead(ctx.checkpoint_dir)
    if isinstance(ctx.target, SlicedTarget):  # the slice's layers, renumbered as its modules are
        source = SlicedTensors(source, list(ctx.target.layers))
    if ctx.target.names == "transformers":
        source = normalize_hf_names(cfg, source)
        cand_notes.append("names: transformers' spellings, read through checkpoint/hf_interop's name map")
    ref_bytes = layout.buffer()
    for n, spec in specs.items():  # one tensor read at a time
        value = _as_module_holds(n, source[prefix + n], spec.shape).to(spec.dtype).contiguous().view(-1)
        offset, size = layout.spans[n]
        if value.numel() * value.element_size() != size:  # the strict load refuses it: its bytes stay zero here
            cand_notes.append(f"{prefix + n}: the checkpoint holds {tuple(source[prefix + n].shape)}, the module "
                              f"{tuple(spec.shape)}")
            continue
        ref_bytes[offset:offset + size].copy_(value.view(torch.uint8))
    return Trial(
        reference={"outcomes": torch.ones(len(scenarios), dtype=torch.int64), "values": layout.words(ref_bytes)},
        candidate={"outcomes": cand_flags, "values": layout.words(cand_bytes)},
        control={"outcomes": ctrl_flags, "values": layout.words(ctrl_bytes)},
        metrics={"tensors": float(len(specs)), "bytes": float(layout.data_bytes)},
        notes=[f"outcomes: {[label for label, _, _ in scenarios]}; values: every module tensor's bytes in spec "
               f"order (each at an 8-byte boundary, compared as 8-byte words) vs the checkpoint read with "
               f"safetensors' own reader (or the synthetic tensors without a dir)",
               *cand_notes, *(f"control: {n}" for n in ctrl_notes)],
    )
