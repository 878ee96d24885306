"""`k3verify quant-report GGUF --checkpoint DIR`: what a GGUF's quantization costs, apart from any server: each
tensor's error against the checkpoint (by kind and by layer), and the next-token distributions of the oracle on
the GGUF in llama.cpp's arithmetic for it against the oracle on the checkpoint, on the endpoint suite's prompts
(mean and p99 KL divergence, top-1 agreement). Writes quant.json and quant.html; exit 0, or 2 for a file that is
not a GGUF, a type the oracle cannot read or multiply, or tensors that do not match the checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from k3verify.commands import Subparsers
from k3verify.errors import UsageError
from k3verify.oracle.conventions import parse_assignment
from k3verify.peers.gguf_target import gguf_target
from k3verify.peers.gguf_weights import GgufError
from k3verify.peers.quant_report import quant_report, write_quant_report
from k3verify.target import DEFAULT_PRESET, TargetError, resolve_target

LENGTHS = {"quick": (5, 17, 40), "full": (5, 17, 40, 64, 3, 100)}  # the endpoint suites' prompt lengths


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("quant-report", help="what a GGUF's quantization costs against its checkpoint",
                              description=__doc__)
    p.add_argument("gguf", type=Path, metavar="GGUF")
    p.add_argument("--checkpoint", type=Path, metavar="DIR", help="the checkpoint the GGUF was made from")
    p.add_argument("--preset", metavar="NAME", help=f"or a synthetic preset (default {DEFAULT_PRESET})")
    p.add_argument("--suite", choices=tuple(LENGTHS), default="quick")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accept-convention", action="append", default=[], metavar="NAME=VALUE",
                   help="evaluate both oracles with this convention (docs/conventions.md)")
    p.add_argument("--report-dir", type=Path, default=Path("reports/quant"), metavar="DIR")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        checkpoint = resolve_target(args.preset, args.checkpoint)
    except TargetError as exc:
        raise UsageError(str(exc)) from exc
    try:
        accepted = [parse_assignment(text, checkpoint.cfg) for text in args.accept_convention]
    except (KeyError, ValueError) as exc:
        raise UsageError(f"--accept-convention: {exc}") from exc
    try:
        gguf = gguf_target(checkpoint, args.gguf)
    except GgufError as exc:
        raise UsageError(str(exc)) from exc
    plain = checkpoint.tokenizer().num_base_tokens
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + 19)
    sequences = [(torch.randint(0, plain, (n,), generator=g).tolist(), 1) for n in LENGTHS[args.suite]]
    report = quant_report(checkpoint, gguf, sequences, accepted=accepted)
    paths = write_quant_report(report, args.report_dir)
    print(report["headline"])
    for kind, row in report["weights"]["by_kind"].items():
        print(f"  {kind:56s} {'/'.join(row['types']):14s} rel RMS {row['rel_rms']:.3g} (max {row['rel_rms_max']:.3g})")
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0
