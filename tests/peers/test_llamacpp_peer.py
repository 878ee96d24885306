"""Upstream llama.cpp's own converter and `llama-server` (CPU, f32 GGUF, pinned numerics) verified by
`parity --endpoint`: a server this project did not write, on Kimi-Linear and Kimi-K3 checkpoints."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hf_checkpoint import write_hf_checkpoint

from k3verify.cli import main
from k3verify.gates.report import load_report
from k3verify.peers.llamacpp import LlamaCpp, RunningServer, llama_server
from k3verify.target import resolve_target


def parity(report: Path, url: str, *args: str, target: tuple[str, str]) -> tuple[int, dict[str, Any]]:
    code = main(["parity", "--endpoint", url, *target, "--dtype", "float32", "--report-dir", str(report), *args])
    return code, load_report(report)


def by_id(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in data["results"]}


@pytest.fixture(scope="module")
def kl_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' save_pretrained of a tiny Kimi-Linear, one head count for KDA and MLA (llama.cpp's graph
    assumes it), the dense MLP under the released checkpoints' name."""
    out = tmp_path_factory.mktemp("kl") / "checkpoint"
    write_hf_checkpoint(out, kda_heads=4, released_spelling=True)
    return out


@pytest.fixture(scope="module")
def kl_gguf(llamacpp: LlamaCpp, kl_checkpoint: Path) -> Path:
    return llamacpp.convert(kl_checkpoint, kl_checkpoint.parent / "kl-f32.gguf")


@pytest.fixture(scope="module")
def kl_server(llamacpp: LlamaCpp, kl_gguf: Path) -> Iterator[RunningServer]:
    with llama_server(llamacpp, kl_gguf, log=kl_gguf.with_suffix(".log")) as server:
        yield server


def gguf_module(llamacpp: LlamaCpp) -> Any:
    sys.path.insert(0, str(llamacpp.tree / "gguf-py"))
    import gguf

    return gguf


def test_vocabulary_hook_changes_only_tokenizer_keys(llamacpp: LlamaCpp, kl_checkpoint: Path, kl_gguf: Path) -> None:
    """The same converter run with no vocabulary written: every tensor (bytes, type, shape) and every metadata key
    outside tokenizer.* is identical, so the hook replaced the vocabulary step and nothing else."""
    bare = llamacpp.convert(kl_checkpoint, kl_checkpoint.parent / "kl-novocab.gguf", vocab="none")
    gguf = gguf_module(llamacpp)
    hooked, plain = gguf.GGUFReader(str(kl_gguf)), gguf.GGUFReader(str(bare))
    assert [t.name for t in hooked.tensors] == [t.name for t in plain.tensors] and len(hooked.tensors) > 50
    for a, b in zip(hooked.tensors, plain.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name

    def keys(reader: Any) -> dict[str, list[bytes]]:  # GGUF.kv_count counts the keys, tokenizer.* included
        return {name: [bytes(p) for p in f.parts] for name, f in reader.fields.items()
                if not name.startswith("tokenizer.") and name != "GGUF.kv_count"}

    assert keys(hooked) == keys(plain)
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre"} <= set(hooked.fields)
    assert not any(name.startswith("tokenizer.ggml.") for name in plain.fields)


def test_kimi_k3_through_llama_server_fails_and_says_where(llamacpp: LlamaCpp, tmp_path: Path) -> None:
    """llama.cpp's Kimi-K3 on k3-tp4 (equal KDA and MLA head counts, which its graph assumes): its greedy tokens
    and logprobs differ from the oracle's; the report fails and names the first differing positions."""
    target = resolve_target("k3-tp4")
    gguf = llamacpp.convert(target.checkpoint_dir, tmp_path / "k3-tp4.gguf")
    with llama_server(llamacpp, gguf, log=tmp_path / "server.log") as server:
        code, data = parity(tmp_path / "report", server.url, target=("--preset", "k3-tp4"))
    results = by_id(data)
    assert code == 1 and data["summary"]["verdict"] == "fail"
    assert results["endpoint.logprobs.topk"]["status"] == "fail"
    greedy = results["endpoint.greedy.tokens"]
    assert greedy["status"] == "fail"
    assert any("where the oracle's greedy token is" in n for n in greedy["notes"]), greedy["notes"]
    assert data["run"]["endpoint"]["capabilities"]["logprob_form"] == "content+id"
