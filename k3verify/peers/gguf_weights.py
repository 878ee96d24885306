"""A GGUF file as a weight source for the oracle: every tensor dequantized by upstream gguf-py (never by code of
ours) and put back under the checkpoint's own tensor names, with the ggml type each one is stored in.

The names come from llama.cpp's converter, inverted: for each tensor of the checkpoint directory the GGUF name
its converter writes (gguf-py's TensorNameMap of the file's architecture, after the converter's own renames: the
router bias, a multimodal prefix) and the layout changes its Kimi-Linear class makes (experts stacked per layer,
kv_b_proj split into a transposed k_b and v_b, A_log written as -exp(A_log), conv kernels reshaped, dt_bias
renamed), undone here. Every GGUF tensor must be used exactly once and every checkpoint tensor found with its
size: anything else is a `GgufError` naming the tensor. A_log is the one value not stored as is: it comes back as
log(-A) computed in fp64 (within an ulp of the checkpoint's).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

GGUF_MAGIC = b"GGUF"
ARCHITECTURES = ("kimi-linear",)  # the converter classes whose layout changes are undone below


class GgufError(ValueError):
    """A file that is not a GGUF, a type gguf-py cannot dequantize, tensors that do not match the checkpoint."""


def gguf_module() -> ModuleType:
    """gguf-py: the pinned llama.cpp tree's own (K3V_LLAMACPP_DIR/llama.cpp/gguf-py), else an installed `gguf`."""
    root = os.environ.get("K3V_LLAMACPP_DIR")
    if root:
        path = Path(root).resolve() / "llama.cpp" / "gguf-py"
        if not (path / "gguf" / "__init__.py").is_file():
            raise GgufError(f"K3V_LLAMACPP_DIR={root}: no gguf-py at {path}; tools/build_llamacpp.sh makes one")
        if "gguf" in sys.modules and not str(getattr(sys.modules["gguf"], "__file__", "")).startswith(str(path)):
            raise GgufError(f"a gguf package other than {path} is already imported "
                            f"({sys.modules['gguf'].__file__}); run in a fresh process")
        sys.path.insert(0, str(path))
        try:
            return importlib.import_module("gguf")
        finally:
            sys.path.remove(str(path))
    try:
        return importlib.import_module("gguf")
    except ImportError as exc:
        raise GgufError("reading a GGUF needs gguf-py: set K3V_LLAMACPP_DIR to a llama.cpp installation "
                        "(tools/build_llamacpp.sh DIR) or `pip install gguf`") from exc


@dataclass
class GgufTensors(Mapping[str, torch.Tensor]):
    """The checkpoint's tensors (raw names of its directory) as the GGUF holds them, fp32; `types`: the ggml type
    each is stored in ({"k_b": .., "v_b": ..} for kv_b_proj, stored as two tensors), `sources`: the GGUF tensor
    each comes from."""

    path: Path
    tensors: dict[str, torch.Tensor]
    types: dict[str, str | dict[str, str]]
    sources: dict[str, str]
    arch: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def type_counts(self) -> dict[str, int]:
        """GGUF tensors by ggml type."""
        counts: dict[str, int] = {}
        for kind in self.gguf_types.values():
            counts[kind] = counts.get(kind, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def gguf_types(self) -> dict[str, str]:
        result: dict[str, str] = self.metadata["gguf_types"]
        return result


def _open(path: Path, gguf: ModuleType) -> Any:
    if not path.is_file():
        raise GgufError(f"{path}: no such file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GgufError(f"{path} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}")
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise GgufError(f"{path}: gguf-py cannot read it: {exc}") from exc


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        raise GgufError(f"{reader.data.filename if hasattr(reader.data, 'filename') else 'the GGUF'}: no {key} key")
    return f.contents()


def _dequantize(gguf: ModuleType, path: Path, tensor: Any) -> np.ndarray:
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise GgufError(f"{path}: tensor {tensor.name} is stored as ggml type {tensor.tensor_type.name}, which "
                        f"gguf-py cannot dequantize ({exc})") from exc
    return np.asarray(values, dtype=np.float32).reshape([int(n) for n in reversed(tensor.shape)])


_EXPERT = ("w1", "w2", "w3")  # gate, down, up as the converter stacks them


def read_gguf_weights(path: str | Path, checkpoint: Mapping[str, tuple[int, ...]], hparams: Mapping[str, Any],
                      ) -> GgufTensors:
    """The GGUF at `path` under the raw tensor names of a checkpoint whose tensors have the shapes `checkpoint`
    (name -> shape) and whose config.json is `hparams`."""
    path = Path(path)
    gguf = gguf_module()
    reader = _open(path, gguf)
    arch = str(_field(reader, "general.architecture"))
    if arch not in ARCHITECTURES:
        raise GgufError(f"{path}: architecture {arch!r}; the oracle reads GGUF weights of {', '.join(ARCHITECTURES)}")
    by_name = {t.name: t for t in reader.tensors}
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    n_blocks = int(hparams["num_hidden_layers"])
    names = gguf.get_tensor_name_map(arch_enum, n_blocks)
    heads = int(hparams["num_attention_heads"])
    nope, v_dim = int(hparams["qk_nope_head_dim"]), int(hparams["v_head_dim"])
    out: dict[str, torch.Tensor] = {}
    types: dict[str, str | dict[str, str]] = {}
    sources: dict[str, str] = {}
    used: set[str] = set()
    cache: dict[str, np.ndarray] = {}

    def load(gname: str, for_name: str) -> np.ndarray:
        if gname not in by_name:
            raise GgufError(f"{path}: no tensor {gname} (the converter's name for checkpoint tensor {for_name}); "
                            "the file does not match this checkpoint")
        used.add(gname)
        if gname not in cache:
            cache[gname] = _dequantize(gguf, path, by_name[gname])
        return cache[gname]

    def mapped(name: str) -> str:
        # the converter's filter_tensors first: the router bias renamed, a multimodal prefix dropped
        key = name.replace("e_score_correction_bias", "e_score_correction.bias").replace("language_model.", "")
        new = names.get_name(key=key, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise GgufError(f"checkpoint tensor {name}: llama.cpp's {arch} tensor map has no name for it")
        return str(new)

    for name, shape in checkpoint.items():
        parts = name.split(".")
        if ".block_sparse_moe.experts." in name:
            bid, expert, which = int(parts[2]), int(parts[5]), parts[6]
            kind = {"w1": "FFN_GATE_EXP", "w2": "FFN_DOWN_EXP", "w3": "FFN_UP_EXP"}[which]
            gname = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, kind)].format(bid=bid) + ".weight"
            value = load(gname, name)[expert]
        elif name.endswith("kv_b_proj.weight"):
            kb_name = mapped(name.replace("kv_b_proj", "k_b_proj"))
            vb_name = mapped(name.replace("kv_b_proj", "v_b_proj"))
            k_b, v_b = load(kb_name, name), load(vb_name, name)  # [h, lora, nope] (transposed), [h, v, lora]
            value = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(heads * (nope + v_dim), -1)
            types[name] = {"k_b": by_name[kb_name].tensor_type.name, "v_b": by_name[vb_name].tensor_type.name}
            sources[name] = kb_name
            out[name] = _checked(path, name, shape, value)
            continue
        elif name.endswith(".A_log"):
            gname = mapped(name)
            value = np.log(-load(gname, name).astype(np.float64))
        elif name.endswith(".dt_bias"):
            gname = mapped(name.rpartition(".dt_bias")[0] + ".dt_proj.bias")
            value = load(gname, name)
        else:
            gname = mapped(name)
            value = load(gname, name)
        types[name] = by_name[gname].tensor_type.name
        sources[name] = gname
        out[name] = _checked(path, name, shape, value)
    unused = sorted(set(by_name) - used)
    if unused:
        raise GgufError(f"{path}: {len(unused)} GGUF tensor(s) no checkpoint tensor maps to, the first "
                        f"{unused[0]}; the file does not match this checkpoint")
    gguf_types = {t.name: t.tensor_type.name for t in reader.tensors}
    metadata = {"gguf_types": gguf_types, "tokenizer_pre": _optional(reader, "tokenizer.ggml.pre"),
                "file_type": _optional(reader, "general.file_type")}
    return GgufTensors(path, out, types, sources, arch, metadata)


def _optional(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _checked(path: Path, name: str, shape: tuple[int, ...], value: np.ndarray) -> torch.Tensor:
    if value.size != int(np.prod(shape)):
        raise GgufError(f"{path}: checkpoint tensor {name} has shape {tuple(shape)} ({int(np.prod(shape))} values); "
                        f"the GGUF's holds {value.size}: the file does not match this checkpoint's config")
    array = value.reshape(shape)
    return torch.from_numpy(np.ascontiguousarray(array.astype(np.float32)))
