"""Acceptance: checkpoints written by other tools, as users have them, reconcile, pass parity and serve.

- transformers `save_pretrained` of a tiny bf16 Kimi-Linear (fp32 routers, bf16 A_log, the dense layer's MLP under
  block_sparse_moe.*, the same eos in config.json and generation_config.json, its own tiktoken vocabulary):
  reconcile --hf-names OK, parity PASS with nothing vacuous, and `serve --dtype float32` answers every prompt with
  transformers' own greedy text.
- a released-layout K3 checkpoint whose A_log is padded to the KDA head dim and whose routers are fp32: reconcile
  OK with the padding reported, parity PASS.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest
import torch
from hf_checkpoint import write_hf_checkpoint

from k3verify import config_json as config_mod
from k3verify.checkpoint.names import checkpoint_specs
from k3verify.checkpoint.reader import CheckpointReader
from k3verify.checkpoint.synthetic import TOKENIZER_ASSETS, _tokenizer_writer, make_synthetic_checkpoint
from k3verify.checkpoint.synthetic_weights import synthetic_group
from k3verify.checkpoint.writer import write_checkpoint, write_streamed_checkpoint
from k3verify.cli import main
from k3verify.config import ModelConfig
from k3verify.gates.report.json_report import load_report
from k3verify.gates.shared import builders
from k3verify.oracle.hf_kimi_linear import torch_kda_paths
from k3verify.presets import preset_hf_config
from k3verify.tokenizer import KimiTokenizer, encode_chat

PROMPTS = ["the lazy dog reads", "hello world", "a tiny model writes the answer", "kimi", "experts and delta rules"]
MAX_NEW = 16
CHAT = [{"role": "user", "content": "weather? [EOS]"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather",
                                                                                "arguments": '{"city": "x"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
MIN_GAP = 1e-4  # fp32 ours vs transformers differ by ~1e-6 relative; a greedy choice closer than this is a tie


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "kimi-linear-tiny"
    write_hf_checkpoint(out)
    return out


def _assert_green(report_dir: Path) -> dict:
    data = load_report(report_dir)
    counts = data["summary"]["counts"]
    assert data["summary"]["verdict"] == "pass" and counts["vacuous"] == counts["fail"] == counts["error"] == 0
    return data


def _transformers_greedy(ckpt: Path, tokenizer: KimiTokenizer) -> list[str]:
    """transformers' own fp32 greedy generation (its torch KDA paths on CPU), cut at eos, specials dropped."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    texts = []
    with torch.no_grad(), torch_kda_paths(torch.device("cpu")):
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
            logits = model(out).logits[0, ids.shape[1] - 1:-1]
            top = logits.topk(2, dim=-1).values
            assert float((top[:, 0] - top[:, 1]).min()) > MIN_GAP, f"{prompt!r}: a near-tie; choose another prompt"
            new = out[0, ids.shape[1]:].tolist()
            new = new[:next((i for i, t in enumerate(new) if t in eos), len(new))]
            texts.append(tokenizer.decode(new, skip_special=True))
    return texts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _served_texts(ckpt: Path, report_dir: Path, dtype: str = "float32", prompts: list[str] = PROMPTS,
                  chat_messages: list[dict] = CHAT) -> list[str]:
    port = _free_port()
    code = "from k3verify.cli import main; raise SystemExit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--checkpoint", str(ckpt), "--dtype", dtype,
                             "--report-dir", str(report_dir), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"serve exited {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.2)
        texts = []
        for prompt in prompts:
            body = {"model": ckpt.name, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        chat = {"model": ckpt.name, "max_tokens": 4, "messages": chat_messages}  # the checkpoint's own template
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(encode_chat(KimiTokenizer.from_dir(ckpt), chat_messages))
        return texts
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.slow
def test_transformers_checkpoint_reconciles_passes_parity_and_serves_transformers_greedy(
        hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert json.loads((hf_dir / "config.json").read_text())["eos_token_id"] == \
        json.loads((hf_dir / "generation_config.json").read_text())["eos_token_id"]
    assert main(["checkpoint", "reconcile", str(hf_dir), "--hf-names"]) == 0
    out = capsys.readouterr().out
    assert "tolerated by rule keep_in_fp32: 4 tensor(s)" in out and "tolerated by rule a_log_bf16: 4" in out
    assert main(["parity", "--checkpoint", str(hf_dir), "--report-dir", str(tmp_path)]) == 0
    data = _assert_green(tmp_path)
    results = {r["id"]: r for r in data["results"]}
    assert results["serving.engine.eos_ids"]["status"] == "pass"
    assert any("only the distinguishing case" in n for n in results["serving.engine.eos_ids"]["notes"])
    assert any("names: transformers" in n for n in results["weights.reconcile.buckets"]["notes"])
    assert results["served.vs_gold"]["status"] == "pass" and "float32" in data["run"]["dtypes"]
    tokenizer = KimiTokenizer.from_dir(hf_dir)
    assert _served_texts(hf_dir, tmp_path) == _transformers_greedy(hf_dir, tokenizer)


def test_eos_check_catches_a_dropped_generation_eos_on_a_same_eos_checkpoint(
        hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With both files naming one eos, only the check's own distinguishing copy can see generation eos dropped."""
    assert main(["parity", "--checkpoint", str(hf_dir), "--only", "serving.engine.eos_ids",
                 "--report-dir", str(tmp_path / "clean")]) == 0
    monkeypatch.setattr(config_mod, "_generation_eos", lambda raw, path: ())
    assert main(["parity", "--checkpoint", str(hf_dir), "--only", "serving.engine.eos_ids",
                 "--report-dir", str(tmp_path / "broken")]) == 1
    [result] = load_report(tmp_path / "broken")["results"]
    assert result["status"] == "fail" and result["per_key"]["distinguishing"]["passed"] is False
    assert result["per_key"]["checkpoint"]["passed"] is True


def test_k3_with_a_log_padded_to_head_dim_and_fp32_routers_reconciles_and_passes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = make_synthetic_checkpoint("k3-tiny", tmp_path / "base").path
    cfg = json.loads((base / "config.json").read_text())
    heads, head_dim = cfg["text_config"]["linear_attn_config"]["num_heads"], \
        cfg["text_config"]["linear_attn_config"]["head_dim"]
    with CheckpointReader(base) as reader:
        tensors = {name: reader[name] for name in reader}
    for name in [n for n in tensors if n.endswith("self_attn.A_log")]:
        padded = torch.zeros(head_dim)  # padded to the head dim, as some writers do, with zeros
        padded[:heads] = tensors[name][:heads]
        tensors[name] = padded
    for name in [n for n in tensors if n.endswith("block_sparse_moe.gate.weight")]:
        tensors[name] = tensors[name].float()
    ckpt = write_checkpoint(cfg, tensors, tmp_path / "k3-padded", shard_max_bytes=1 << 20,
                            generation_config=json.loads((base / "generation_config.json").read_text()),
                            tokenizer_dir=TOKENIZER_ASSETS).path
    assert main(["checkpoint", "reconcile", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "tolerated by rule a_log_padding: 4 tensor(s)" in out
    assert f"length {head_dim} for {heads} heads: {head_dim - heads} padding value(s), 1 distinct (0)" in out
    assert "tolerated by rule keep_in_fp32: 5 tensor(s)" in out and "result: OK" in out
    assert main(["parity", "--checkpoint", str(ckpt), "--report-dir", str(tmp_path / "report")]) == 0
    data = _assert_green(tmp_path / "report")
    notes = {r["id"]: r["notes"] for r in data["results"]}["weights.reconcile.buckets"]
    assert any("a_log_padding" in n and "padding value(s)" in n for n in notes)


def _real_vocab_kl_tiny(out: Path) -> Path:
    """kl-tiny's widths with a real config's vocabulary and ids (163840; [BOS] 163584, eos 163585 / 163586,
    [PAD] 163839) and the tokenizer `checkpoint make` writes for real shapes, written shard by shard."""
    hf = preset_hf_config("kl-tiny") | {"vocab_size": 163840, "bos_token_id": 163584, "eos_token_id": 163585,
                                         "pad_token_id": 163839}
    cfg = ModelConfig.from_hf_dict(hf, generation_eos=(163586,))
    specs = checkpoint_specs(cfg)
    return write_streamed_checkpoint(
        hf, {n: (s.shape, s.dtype) for n, s in specs.items()}, lambda names: synthetic_group(cfg, specs, names), out,
        shard_max_bytes=8 << 20, generation_config={"bos_token_id": 163584, "eos_token_id": 163586},
        tokenizer=_tokenizer_writer(cfg)).path


@pytest.mark.slow
def test_real_size_chain_on_cpu_gates_layer_by_layer_and_serves(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU `realsize` chain in miniature: a real-vocab checkpoint treated as real size (no whole model may be
    built but the served one) runs model.layerwise.sublayers and the transformers-gold model check, but the
    whole-model checks skip for size, naming the sizes, so the verdict is INCONCLUSIVE (a PASS needs no size skip)
    until they run layer-streamed or on a slice."""
    ckpt = _real_vocab_kl_tiny(tmp_path / "kl-real-vocab")
    monkeypatch.setattr(builders, "WHOLE_MODEL_BYTES", 1 << 20)
    assert main(["parity", "--checkpoint", str(ckpt), "--report-dir", str(tmp_path / "report")]) == 4
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    status = {r["id"]: (r["status"], r["reason"] or "") for r in data["results"]}
    for check in ("model.layerwise.sublayers", "served.vs_transformers", "serving.engine.eos_ids",
                  "serving.state.slot_reuse", "weights.reconcile.buckets", "tokenizer.encode.exact_ids"):
        assert status[check][0] == "pass", (check, status[check])
    for check in ("model.logits.fp32", "weights.loader.strict", "served.vs_gold", "kda.module.fp32"):
        assert status[check][0] == "skipped" and "real size:" in status[check][1], (check, status[check])
    assert data["summary"]["verdict"] == "inconclusive"
