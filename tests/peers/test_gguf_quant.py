"""Quantized GGUFs made by llama.cpp's own llama-quantize, verified through upstream llama-server: the oracle runs
on the file's own weights (`--weights-from`) in llama.cpp's CPU arithmetic for them (`--dtype w-gguf-a8`), so a
correct server passes on a Q8_0 file and on a Q4_K_M file (k-quants, kl-256's widths) with no rounding excused,
and a fault in the file it serves, its tokenizer or its cache fails; the quantization's own cost is measured apart
(the quantization report)."""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf_helpers import gguf_module
from hf_checkpoint import write_hf_checkpoint

from k3verify.cli import main
from k3verify.gates.report.json_report import load_report
from k3verify.oracle import functional as Fn
from k3verify.oracle import gguf_arith
from k3verify.peers.gguf_weights import read_gguf_weights
from k3verify.peers.llamacpp import LlamaCpp, RunningServer, llama_server
from k3verify.presets import KL_256

ACCEPT_L2 = ("--accept-convention", "kda.l2norm_eps=rms_norm_eps")  # llama.cpp's known KDA deviation
NO_PROMPT_CACHE = ("--no-cache-prompt",)
SCALE_AT = {"Q8_0": 0, "Q4_K": 0}  # byte offset of a block's (first) fp16 scale: Q8_0's d, Q4_K's super-block d


def parity(report: Path, url: str, checkpoint: Path, gguf: Path, *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["parity", "--endpoint", url, "--checkpoint", str(checkpoint), "--weights-from", str(gguf),
                 "--dtype", "w-gguf-a8", *ACCEPT_L2, "--report-dir", str(report), *args])
    return code, load_report(report)


def failed(data: dict[str, Any]) -> list[str]:
    return [r["id"] for r in data["results"] if r["status"] == "fail"]


@pytest.fixture(scope="module")
def q8_gguf(llamacpp: LlamaCpp, kl_gguf: Path) -> Path:
    return llamacpp.quantize(kl_gguf, kl_gguf.with_name("kl-q8_0.gguf"), "Q8_0")


@pytest.fixture(scope="module")
def q8_server(llamacpp: LlamaCpp, q8_gguf: Path) -> Iterator[RunningServer]:
    with llama_server(llamacpp, q8_gguf, log=q8_gguf.with_suffix(".log"), extra=NO_PROMPT_CACHE) as server:
        yield server


def test_the_gguf_maps_back_to_every_checkpoint_tensor(kl_checkpoint: Path, kl_gguf: Path) -> None:
    """The converter's tensor map inverted, key by key against the converter's own output: every checkpoint tensor
    comes back from the f32 GGUF bit for bit (A_log, stored as -exp(A_log), within an ulp), every GGUF tensor is
    used once, and kv_b_proj is rebuilt from the split, transposed k_b and v_b."""
    from k3verify.checkpoint.reader import CheckpointReader

    with CheckpointReader(kl_checkpoint) as reader:
        shapes = {n: tuple(e.shape) for n, e in reader.entries.items()}
        import json

        back = read_gguf_weights(kl_gguf, shapes, json.loads((kl_checkpoint / "config.json").read_text()))
        assert set(back) == set(shapes)
        for name in shapes:
            want = reader[name].float()
            if name.endswith(".A_log"):
                torch.testing.assert_close(back[name], want, rtol=2e-7, atol=0)
            else:
                assert torch.equal(back[name], want), name
    assert back.types["model.layers.3.self_attn.kv_b_proj.weight"] == {"k_b": "F32", "v_b": "F32"}
    assert back.sources["model.layers.2.block_sparse_moe.experts.5.w2.weight"] == "blk.2.ffn_down_exps.weight"


def _ggml_quantizer(llamacpp: LlamaCpp, type_id: int) -> Any:
    """ggml-cpu's own `from_float` for ggml type `type_id`, from the build's shared library."""
    lib = next((p for p in (llamacpp.server.parent / "libggml-cpu.so", llamacpp.server.parent.parent / "ggml" /
                            "src" / "libggml-cpu.so") if p.is_file()), None)
    if lib is None:
        pytest.skip(f"no libggml-cpu.so beside {llamacpp.server} (a static build): ggml's quantizers not callable")
    cpu = ctypes.CDLL(str(lib))
    cpu.ggml_cpu_init()

    class Traits(ctypes.Structure):
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                    ("nrows", ctypes.c_int64)]

    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    return fn(cpu.ggml_get_type_traits_cpu(type_id).contents.from_float)


def _exact_ties(g: np.random.Generator, rows: int) -> np.ndarray:
    """Rows of 512 whose scaled products land exactly on a tie (k + 1/2) under ggml's scale 127/max computed as
    one fp32 division, with a max for which 127 x (1/max) is another fp32 number: a quantizer that scales any
    other way, or rounds ties any other way, gets other codes. Every 32-block starts with the max."""
    out = np.zeros((rows, 512), dtype=np.float32)
    for r in range(rows):
        while True:
            peak = np.float32(g.uniform(1, 2) * 2.0 ** g.integers(-8, 8))
            iscale = np.float32(127) / peak
            if iscale != np.float32(127) * (np.float32(1) / peak):
                break
        for j in range(512):
            if j % 32 == 0:
                out[r, j] = peak
                continue
            k = int(g.integers(-126, 126)) + 0.5
            x = np.float32(k / float(iscale))
            for _ in range(8):  # the fp32 neighbours of k / iscale: one of them usually scales to k + 1/2 exactly
                if np.float32(x * iscale) == k:
                    break
                x = np.nextafter(x, np.float32(np.inf if np.float32(x * iscale) < k else -np.inf))
            out[r, j] = x
    return out


def _rows() -> torch.Tensor:
    """Random rows of many magnitudes, rows of exact ties, a row of zeros."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-3, 2, 64)[:, None]
    ties = torch.from_numpy(_exact_ties(np.random.default_rng(3), 16))
    return torch.cat([x, ties, -ties, torch.zeros(1, 512)])


def test_activation_quantizers_are_ggml_s_bit_for_bit(llamacpp: LlamaCpp) -> None:
    """Q8_0 (fp16 scale, codes) and Q8_K (fp32 scale, codes) of the oracle against ggml-cpu's own quantizers,
    called in the built library, on random rows and rows of exact ties."""
    x = _rows()
    q8_0 = _ggml_quantizer(llamacpp, 8)
    q8_k = _ggml_quantizer(llamacpp, 15)
    for row in x:
        src = np.ascontiguousarray(row.numpy())
        out = np.zeros(512 // 32 * 34, dtype=np.uint8)
        q8_0(src.ctypes.data, out.ctypes.data, 512)
        blocks = out.reshape(16, 34)
        _, q, d = Fn.q8_0_codes(row)
        assert np.array_equal(blocks[:, :2].copy().view(np.float16).astype(np.float32).ravel(), d.numpy().ravel())
        assert np.array_equal(blocks[:, 2:].view(np.int8), q.numpy().astype(np.int8))
        out_k = np.zeros(2 * (4 + 256 + 32), dtype=np.uint8)
        q8_k(src.ctypes.data, out_k.ctypes.data, 512)
        kb = out_k.reshape(2, 292)
        qk, dk = gguf_arith.q8_k_codes(row)
        assert np.array_equal(kb[:, :4].copy().view(np.float32).ravel(), dk.numpy().ravel())
        assert np.array_equal(kb[:, 4:260].view(np.int8), qk.numpy().astype(np.int8))


def test_a_q8_0_file_through_llama_server_passes_and_its_quantization_cost_is_reported(
        q8_server: RunningServer, kl_checkpoint: Path, q8_gguf: Path, tmp_path: Path) -> None:
    """Every endpoint check passes with no rounding excused; the quantization report puts the server's own top-k
    KL against the GGUF's oracle far below what the quantization costs against the checkpoint."""
    code, data = parity(tmp_path / "q8", q8_server.url, kl_checkpoint, q8_gguf)
    assert code == 0, [(r["id"], r["status"], r["reason"]) for r in data["results"] if r["status"] != "pass"]
    assert not any(r["metrics"].get("excused_rounding_near_ties") for r in data["results"])
    endpoint = data["run"]["endpoint"]
    assert endpoint["weights_from"]["types"]["Q8_0"] > 50
    quant = endpoint["quantization"]
    assert quant["model"]["kl_mean"] > 1e-3 and quant["weights"]["by_kind"]["lm_head.weight"]["types"] == ["Q8_0"]
    server = quant["server"]["vs_gguf"]
    assert server["kl_mean"] < 0.05 * quant["model"]["kl_mean"], quant["headline"]
    assert server["top1_agreement"] >= 0.9  # greedy near-ties aside (endpoint.greedy.tokens judges those)
    assert (tmp_path / "q8" / "quant.html").read_text().count("<polyline") >= 2
    page = (tmp_path / "q8" / "report.html").read_text()  # the plots by layer and by position in the report too
    section = page[page.index('<section id="quantization">'):]
    assert section.count("<polyline") >= 3 and "KL divergence by position" in section


def _alter_block_scale(gguf: Any, src: Path, dst: Path, tensor: str, kind: str) -> None:
    """A copy of `src` with the fp16 scale of the first block of `tensor` (stored as ggml type `kind`) negated."""
    shutil.copyfile(src, dst)
    t = next(t for t in gguf.GGUFReader(str(src)).tensors if t.name == tensor)
    assert t.tensor_type.name == kind
    with dst.open("r+b") as f:
        f.seek(t.data_offset + SCALE_AT[kind])
        scale = np.frombuffer(f.read(2), dtype=np.float16)
        assert scale != 0, (tensor, kind)
        f.seek(t.data_offset + SCALE_AT[kind])
        f.write((-scale).tobytes())


def test_faults_in_a_served_q8_0_file_fail_naming_the_check(llamacpp: LlamaCpp, kl_checkpoint: Path, kl_gguf: Path,
                                                            q8_gguf: Path, tmp_path: Path) -> None:
    """The oracle reads the original Q8_0 file; the server runs (a) a copy with one block's scale negated: the
    logprob checks fail; (b) a file quantized from the same f32 GGUF with its tokenizer pre-type changed to
    another valid one, with the prompt cache on: the chat rendering's token ids fail, and the repeated prompt."""
    altered = tmp_path / "scale.gguf"
    _alter_block_scale(gguf_module(llamacpp), q8_gguf, altered, "blk.1.attn_output.weight", "Q8_0")
    with llama_server(llamacpp, altered, log=tmp_path / "scale.log", extra=NO_PROMPT_CACHE) as server:
        code, data = parity(tmp_path / "scale", server.url, kl_checkpoint, q8_gguf)
    assert code == 1 and "endpoint.logprobs.topk" in failed(data), failed(data)
    pre = llamacpp.quantize(kl_gguf, tmp_path / "pre.gguf", "Q8_0",
                            extra=("--override-kv", "tokenizer.ggml.pre=str:whitespace"))
    with llama_server(llamacpp, pre, log=tmp_path / "pre.log") as server:
        code, data = parity(tmp_path / "pre", server.url, kl_checkpoint, q8_gguf)
    assert code == 1 and {"endpoint.chat.template", "endpoint.repeat.identity"} <= set(failed(data)), failed(data)
    assert "endpoint.logprobs.topk" not in failed(data)  # the weights are the same: only the tokenizer is wrong


# kl-256's test model: a contractive body under a sharp head. Random weights at transformers' init std 0.1 give
# every 256-wide row a gain of about 0.1 x sqrt(256) = 1.6, so one activation code taken the other way at a near-tie
# grows layer by layer until two correct runs of the quantized file differ by the format's whole rounding error: the
# logprob check can then only skip (a trained model is not chaotic in this way, a random one with gain > 1 is).
# Linear layers at std 0.03 (gain about 0.5) under embeddings and an lm_head 20 x that: the embedding dominates the
# residual stream, so a flip's effect decays through the layers, and the logits keep clear gaps between the top
# tokens. The checks' bars and rules are those of every other model; only these weights differ.
KL_256_BODY_STD = 0.03
KL_256_EMBED_HEAD_X = 20.0


def _scale_in_place(checkpoint: Path, factors: dict[str, float]) -> None:
    """Multiply the named tensors of a single-file safetensors checkpoint by their factors, in their own dtype."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = checkpoint / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    for name, factor in factors.items():
        tensors[name] = (tensors[name].float() * factor).to(tensors[name].dtype)
    save_file(tensors, str(path), metadata=metadata)


@pytest.fixture(scope="module")
def kl256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A transformers-written checkpoint of kl-256's widths (presets.py) with this folder's tokenizer, its weights a
    contractive body under a sharp head (above)."""
    out = tmp_path_factory.mktemp("kl256") / "checkpoint"
    write_hf_checkpoint(out, kda_heads=4, released_spelling=True,
                        overrides={**KL_256, "initializer_range": KL_256_BODY_STD})
    _scale_in_place(out, {"model.embed_tokens.weight": KL_256_EMBED_HEAD_X, "lm_head.weight": KL_256_EMBED_HEAD_X})
    return out


@pytest.fixture(scope="module")
def kl256_f32(llamacpp: LlamaCpp, kl256: Path) -> Path:
    return llamacpp.convert(kl256, kl256.parent / "kl256-f32.gguf")


@pytest.fixture(scope="module")
def q4_gguf(llamacpp: LlamaCpp, kl256_f32: Path) -> Path:
    return llamacpp.quantize(kl256_f32, kl256_f32.with_name("kl256-q4_k_m.gguf"), "Q4_K_M")


def test_kl_256_s_q4_k_m_file_holds_k_quants(llamacpp: LlamaCpp, q4_gguf: Path) -> None:
    """kl-256's rows are whole Q8_K blocks, so llama-quantize's Q4_K_M writes its k-quants there (Q4_K, and Q6_K
    for the output and half the down projections), Q8_K activations; the 32- and 64-wide rows fall back to
    Q5_0/Q8_0 (Q8_0 activations)."""
    types = {t.tensor_type.name for t in gguf_module(llamacpp).GGUFReader(str(q4_gguf)).tensors}
    assert {"Q4_K", "Q6_K"} <= types and types & {"Q5_0", "Q8_0"}, types


def test_a_q4_k_m_file_through_llama_server_passes(q4_gguf: Path, llamacpp: LlamaCpp, kl256: Path,
                                                  tmp_path: Path) -> None:
    """Every endpoint check passes with no rounding excused, the logprob check included: on this model the oracle's
    own fp32-vs-fp64 distance in llama.cpp's arithmetic for Q4_K/Q5_K/Q6_K weights (Q8_K activations) is small
    enough to make a bar, and llama-server sits within it."""
    with llama_server(llamacpp, q4_gguf, log=tmp_path / "q4.log", extra=NO_PROMPT_CACHE) as server:
        code, data = parity(tmp_path / "q4", server.url, kl256, q4_gguf)
    results = {r["id"]: r for r in data["results"]}
    assert code == 0, [(r["id"], r["status"], r["reason"]) for r in data["results"] if r["status"] != "pass"]
    assert not any(r["metrics"].get("excused_rounding_near_ties") for r in data["results"])
    assert not any(r["metrics"].get("excused_near_ties") for r in data["results"])
    topk = results["endpoint.logprobs.topk"]
    assert topk["status"] == "pass" and topk["metrics"]["rows"] > 0, topk
    types = data["run"]["endpoint"]["weights_from"]["types"]
    assert types["Q4_K"] > 0 and types["Q6_K"] > 0, types


def test_faults_in_a_served_q4_k_m_file_fail_naming_the_check(llamacpp: LlamaCpp, kl256: Path, kl256_f32: Path,
                                                             q4_gguf: Path, tmp_path: Path) -> None:
    """The oracle reads the original Q4_K_M file; the server runs (a) a copy with one Q4_K super-block's scale
    negated (blk.1.attn_q): the logprob check and the greedy tokens fail; (b) a file quantized from the same f32
    GGUF with its tokenizer pre-type changed to another valid one, served with its prompt cache on: the chat
    rendering's token ids fail (the pre-tokenizer) and the repeated short prompt of the prefix check (the prompt
    cache), the logprobs passing."""
    altered = tmp_path / "scale.gguf"
    _alter_block_scale(gguf_module(llamacpp), q4_gguf, altered, "blk.1.attn_q.weight", "Q4_K")
    with llama_server(llamacpp, altered, log=tmp_path / "scale.log", extra=NO_PROMPT_CACHE) as server:
        code, data = parity(tmp_path / "scale", server.url, kl256, q4_gguf, "--no-explain")
    assert code == 1 and {"endpoint.logprobs.topk", "endpoint.greedy.tokens"} <= set(failed(data)), failed(data)
    pre = llamacpp.quantize(kl256_f32, tmp_path / "pre.gguf", "Q4_K_M",
                            extra=("--override-kv", "tokenizer.ggml.pre=str:whitespace"))
    with llama_server(llamacpp, pre, log=tmp_path / "pre.log") as server:
        code, data = parity(tmp_path / "pre", server.url, kl256, q4_gguf, "--no-explain")
    assert code == 1 and {"endpoint.chat.template", "endpoint.prefix.reuse"} <= set(failed(data)), failed(data)
    assert "endpoint.logprobs.topk" not in failed(data)  # the weights are the same: only the tokenizer is wrong


def test_bad_weight_files_are_setup_errors_naming_the_value(llamacpp: LlamaCpp, kl_checkpoint: Path, kl_gguf: Path,
                                                           kl256: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 and a message naming the value: not a GGUF, a GGUF of another checkpoint's shapes, a weight type
    the oracle cannot multiply (Q4_1's dot product adds an fp16 block sum)."""
    q4_1 = llamacpp.quantize(kl_gguf, tmp_path / "q4_1.gguf", "Q4_1")
    cases = {kl_checkpoint / "config.json": "is not a GGUF file: it starts with b'{",
             kl_gguf: "the file does not match this checkpoint", q4_1: "ggml type Q4_1"}
    for gguf, message in cases.items():
        target = kl256 if gguf == kl_gguf else kl_checkpoint
        code = main(["quant-report", str(gguf), "--checkpoint", str(target), "--report-dir", str(tmp_path / "r")])
        err = capsys.readouterr().err
        assert code == 2 and message in err, (gguf, err)
