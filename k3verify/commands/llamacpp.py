"""`k3verify llamacpp`: upstream llama.cpp as a peer to verify. `convert` makes a GGUF of a checkpoint with
llama.cpp's own converter (the vocabulary written from the checkpoint's tiktoken files); `serve` runs its
llama-server on 127.0.0.1 with pinned numerics until interrupted, printing the URL for `parity --endpoint`.
The installation comes from --llamacpp DIR or K3V_LLAMACPP_DIR (tools/build_llamacpp.sh makes one)."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

from k3verify.commands import Subparsers
from k3verify.errors import UsageError
from k3verify.peers.llamacpp import ENV_DIR, PINNED, LlamaCpp, LlamaCppError, llama_server


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("llamacpp", help="convert a checkpoint with llama.cpp's converter / run its server",
                              description=__doc__)
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    convert = sub.add_parser("convert", help="a GGUF of a checkpoint, made by llama.cpp's own converter")
    convert.add_argument("checkpoint", type=Path)
    convert.add_argument("out", type=Path, help="the GGUF file to write")
    convert.add_argument("--outtype", default="f32", choices=("f32", "f16", "bf16", "q8_0"),
                         help="llama.cpp's --outtype (default f32: the numerics to verify first)")
    serve = sub.add_parser("serve", help="llama-server on 127.0.0.1 with pinned numerics, until Ctrl-C")
    serve.add_argument("gguf", type=Path)
    serve.add_argument("--context", type=int, default=4096)
    serve.add_argument("--server-args", default="", metavar="ARGS",
                       help="more llama-server arguments, one string; write it with '=' when it starts with a dash "
                            "(--server-args=--no-cache-prompt)")
    for q in (convert, serve):
        q.add_argument("--llamacpp", type=Path, metavar="DIR", help=f"installation (default: ${ENV_DIR})")
        q.set_defaults(func=run)


def _peer(args: argparse.Namespace) -> LlamaCpp:
    try:
        return LlamaCpp.at(args.llamacpp) if args.llamacpp is not None else LlamaCpp.from_env()
    except LlamaCppError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    peer = _peer(args)
    try:
        if args.action == "convert":
            out = peer.convert(args.checkpoint, args.out, outtype=args.outtype)
            print(f"{out} (llama.cpp {peer.version()}, --outtype {args.outtype})")
            return 0
        try:
            extra = shlex.split(args.server_args)
        except ValueError as exc:
            raise UsageError(f"--server-args {args.server_args!r}: {exc} (quote as a shell would)") from None
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a terminated `serve` stops its server too
        log = Path(tempfile.mkstemp(prefix="llama-server.", suffix=".log")[1])
        with llama_server(peer, args.gguf, log=log, context=args.context, extra=extra) as server:
            print(f"llama-server (llama.cpp {peer.version()}) at {server.url}/v1, log {log}", flush=True)
            print(f"pinned: {' '.join(PINNED)}{' ' + ' '.join(extra) if extra else ''}", flush=True)
            while server.process.poll() is None:
                time.sleep(0.5)
            print(f"llama-server exited with {server.process.returncode}:\n{server.log_tail()}")
            return 1
    except LlamaCppError as exc:
        raise UsageError(str(exc)) from None
    except KeyboardInterrupt:
        return 0
