"""`serve` loads what it hashed: the checkpoint is read once into memory, its digest is of those bytes, and the
config, weights and tokenizer (the engine's and the HTTP front end's) are built from them; a file swapped after
start is never served, before the snapshot it is refused, and a restarted engine reads and checks again."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from gate_reports import write_report

from k3verify.checkpoint.digest import checkpoint_digest, covered_files
from k3verify.checkpoint.reader import CheckpointReader
from k3verify.checkpoint.synthetic import ensure_preset_checkpoint
from k3verify.cli import build_parser
from k3verify.commands.serve_engine import GatedTarget, load_served
from k3verify.commands.serve_options import ServeOptions
from k3verify.errors import UsageError
from k3verify.target import resolve_target, snapshot_target
from k3verify.tokenizer import KIMI_CHAT_TEMPLATE
from tools import chaos_kill

INJECTED = "INJECTED-BY-SWAP"  # no trailing space: the template's `{%-` strips whitespace
CHAT = {"messages": [{"role": "user", "content": "hello"}]}


def copy_tiny(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ensure_preset_checkpoint("k3-tiny"), ckpt)
    return ckpt


def swap(path: Path) -> None:
    """Replace a covered file by another (new inode, as `mv` would); the tokenizer config gains a template that
    starts every chat prompt with INJECTED, any other file one changed byte."""
    data = path.read_bytes()
    if path.name == "tokenizer_config.json":
        config = json.loads(data)
        config["chat_template"] = INJECTED + KIMI_CHAT_TEMPLATE
        data = json.dumps(config).encode()
    elif path.suffix == ".json":
        data = data.rstrip() + b" \n"
    else:
        middle = len(data) // 2
        data = data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:]
    tmp = path.with_name(path.name + ".swap")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_every_covered_file_swapped_after_the_snapshot_changes_nothing_served(tmp_path: Path) -> None:
    """Snapshot, then swap every file the digest covers: the snapshot's digest (equal to the directory's digest
    before), config, tensors and tokenizer are still the originals, while the directory's digest has moved."""
    ckpt = copy_tiny(tmp_path)
    before = checkpoint_digest(ckpt)
    served = snapshot_target(resolve_target(checkpoint=ckpt))
    assert served.target.digest == before
    original = {name: t.clone() for name, t in CheckpointReader(ckpt).items()}
    for path in covered_files(ckpt):
        swap(path)
    assert checkpoint_digest(ckpt) != before
    assert served.target.digest == before and served.target.cfg == resolve_target("k3-tiny").cfg
    weights = served.weights()
    assert set(weights) == set(original)
    assert all(torch.equal(weights[n], t) and weights[n].dtype == t.dtype for n, t in original.items())
    tokenizer = served.tokenizer()
    assert INJECTED not in (tokenizer.chat_template or "") and INJECTED not in (served.tokenizer_bytes().load()
                                                                                .chat_template or "")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors.index.json",
                                  "model-00002-of-00003.safetensors", "tiktoken.model", "tokenizer_config.json"])
def test_a_file_swapped_between_gate_and_snapshot_is_refused(tmp_path: Path, name: str) -> None:
    """The gate matched the directory's digest; a file swapped before the engine reads it gives the snapshot
    another digest: refused, naming both digests."""
    ckpt = copy_tiny(tmp_path)
    gated = GatedTarget(resolve_target(checkpoint=ckpt), tmp_path / "report.json")
    swap(ckpt / name)
    args = ServeOptions.from_args(build_parser().parse_args(["serve", "--checkpoint", str(ckpt)]))
    want = (f"changed after the gate checked it: the bytes read to serve have digest sha256:[0-9a-f]{{64}}, the gate "
            f"report .* vouches for {gated.target.digest}")
    with pytest.raises(UsageError, match=want):
        load_served(args, gated)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompt_text(url: str) -> str:
    ids = httpx.post(f"{url}/tokenize", json=CHAT, timeout=30).json()["tokens"]
    return str(httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"])


def _settle(server: Any, timeout: float) -> str:
    """'served' once /health answers 200, 'refused' once serve exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return "refused"
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return "served"
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("serve neither served nor exited")


@pytest.mark.parametrize("moment", [0.0, 0.5, 1.5, "after the first request"])
def test_tokenizer_swapped_after_start_is_never_served(tmp_path: Path, moment: float | str) -> None:
    """tokenizer_config.json swapped 0, 0.5 or 1.5 s after the "vouches for" line, or after the first request: serve
    either refuses (exit 2: the bytes it read are not the gated ones) or serves the gated template, never the
    swapped one; after the first request a restarted front end still serves the gated template, and a restarted
    engine, which reads the directory again, refuses."""
    ckpt = copy_tiny(tmp_path)
    write_report(tmp_path / "reports", digest=checkpoint_digest(ckpt))
    kill = chaos_kill
    server = kill.ServeProcess("--checkpoint", str(ckpt), "--report-dir", str(tmp_path / "reports"),
                               port=_free_port())
    try:
        deadline = time.monotonic() + 60
        while not any("vouches for" in line for line in server.lines):
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log()
            time.sleep(0.01)
        if isinstance(moment, float):
            time.sleep(moment)
        else:
            assert _settle(server, 120) == "served", server.log()
            assert INJECTED not in _prompt_text(server.url)
        swap(ckpt / "tokenizer_config.json")
        outcome = _settle(server, 120)
        when = moment if isinstance(moment, str) else f"{moment} s after the gate line"
        print(f"tokenizer swapped {when}: {outcome}")
        if outcome == "refused":
            assert server.proc.wait(30) == 2 and "changed after the gate checked it" in server.log(), server.log()
            return
        assert INJECTED not in _prompt_text(server.url), "the swapped tokenizer is served"
        if moment == "after the first request":
            os.kill(server.pids["HTTP front end"], 9)
            time.sleep(0.5)
            assert _settle(server, 60) == "served"
            assert INJECTED not in _prompt_text(server.url), "a restarted front end serves the swapped tokenizer"
            os.kill(server.pids["engine"], 9)
            assert server.proc.wait(120) == 2, server.log()
            assert "the restarted engine process refused" in server.log() and "changed after the gate" in server.log()
    finally:
        server.stop()
