"""Upstream llama.cpp as a peer: where a build is, its converter run on a checkpoint, its `llama-server` started
on a free loopback port with pinned numerics and stopped again.

A llama.cpp installation here is a directory holding the source tree (`llama.cpp/`, with `convert_hf_to_gguf.py`
and `gguf-py`) and a build of the server (`build/bin/llama-server`), as `tools/build_llamacpp.sh` leaves it; the
environment variable K3V_LLAMACPP_DIR names it. Numerics are pinned so a run can be repeated and compared: a fixed
thread count, an f32 KV cache (llama.cpp's default is f16), no flash attention, one slot, a fixed seed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ENV_DIR = "K3V_LLAMACPP_DIR"
PINNED = ("--threads", "1", "--threads-batch", "1", "--cache-type-k", "f32", "--cache-type-v", "f32",
          "--flash-attn", "off", "--parallel", "1", "--seed", "0", "--no-webui")
START_TIMEOUT_S = 60.0


class LlamaCppError(RuntimeError):
    """A llama.cpp installation that is missing or broken, a conversion or a server start that failed."""


@dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp source tree and its llama-server build."""

    tree: Path
    server: Path

    @property
    def quantizer(self) -> Path:
        """llama-quantize, built beside the server (tools/build_llamacpp.sh builds both)."""
        return self.server.parent / "llama-quantize"

    @classmethod
    def at(cls, root: str | Path) -> LlamaCpp:
        root = Path(root).resolve()
        tree, server = root / "llama.cpp", root / "build" / "bin" / "llama-server"
        if not (tree / "convert_hf_to_gguf.py").is_file():
            raise LlamaCppError(f"{root}: no llama.cpp source tree at {tree} (convert_hf_to_gguf.py missing); "
                                "tools/build_llamacpp.sh makes one")
        if not os.access(server, os.X_OK):
            raise LlamaCppError(f"{root}: no llama-server build at {server}; tools/build_llamacpp.sh builds it")
        return cls(tree, server)

    @classmethod
    def from_env(cls) -> LlamaCpp:
        root = os.environ.get(ENV_DIR)
        if not root:
            raise LlamaCppError(f"{ENV_DIR} is not set: point it at a llama.cpp installation "
                                "(tools/build_llamacpp.sh DIR builds one)")
        return cls.at(root)

    def version(self) -> str:
        """The release the tree was packaged as (tools/build_llamacpp.sh writes VERSION beside it)."""
        marker = self.tree.parent / "VERSION"
        return marker.read_text().strip() if marker.is_file() else "unknown"

    def convert(self, checkpoint: str | Path, out: str | Path, *, outtype: str = "f32", vocab: str = "checkpoint",
                extra: Sequence[str] = ()) -> Path:
        """The checkpoint as a GGUF file, made by llama.cpp's own converter (the vocabulary step replaced:
        peers/llamacpp_convert.py). The converter writes beside `out` under a temporary name, renamed to `out` only
        when it succeeded: a failed conversion (a truncated shard, say) leaves no partial GGUF behind."""
        out = Path(out)
        partial = out.with_name(f".{out.stem}.partial{out.suffix}")  # renamed to `out` only once complete
        cmd = [sys.executable, "-m", "k3verify.peers.llamacpp_convert", "--tree", str(self.tree), "--vocab", vocab,
               "--", str(checkpoint), "--outfile", str(partial), "--outtype", outtype, *extra]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0 or not partial.is_file():
                tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
                raise LlamaCppError(f"llama.cpp's converter failed on {checkpoint} (exit {done.returncode}); "
                                    f"nothing was written to {out}:\n{tail}")
            os.replace(partial, out)
        finally:
            partial.unlink(missing_ok=True)
        return out


    def quantize(self, source: str | Path, out: str | Path, file_type: str, extra: Sequence[str] = ()) -> Path:
        """`source` (a GGUF) re-quantized by llama-quantize to `file_type` (Q8_0, Q4_K_M, ...), one thread."""
        if not os.access(self.quantizer, os.X_OK):
            raise LlamaCppError(f"no llama-quantize build at {self.quantizer}; tools/build_llamacpp.sh builds it")
        out = Path(out)
        cmd = [str(self.quantizer), *extra, str(source), str(out), file_type, "1"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.is_file():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
            raise LlamaCppError(f"llama-quantize {file_type} failed on {source} (exit {done.returncode}):\n{tail}")
        return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningServer:
    url: str
    command: list[str]
    log: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])


@contextmanager
def llama_server(peer: LlamaCpp, gguf: str | Path, *, log: str | Path, context: int = 4096,
                 extra: Sequence[str] = ()) -> Iterator[RunningServer]:
    """llama-server on 127.0.0.1 at a free port with the pinned numerics (PINNED) plus `extra`; yields once its
    /health answers 200, stops it on exit. A server that exits or never gets healthy raises with its log's tail."""
    port = free_port()
    cmd = [str(peer.server), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--ctx-size", str(context), *PINNED, *extra]
    log = Path(log)
    with log.open("wb") as sink:
        process = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    server = RunningServer(f"http://127.0.0.1:{port}", cmd, log, process)
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(process)


def _wait_healthy(server: RunningServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise LlamaCppError(f"llama-server exited with {server.process.returncode} at start:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise LlamaCppError(f"llama-server not healthy after {START_TIMEOUT_S:.0f} s:\n{server.log_tail()}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
