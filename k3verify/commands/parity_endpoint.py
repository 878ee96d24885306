"""`k3verify parity --endpoint URL`: verify a running OpenAI-compatible server against the oracle.

The oracle runs here on the checkpoint (--device); the server is driven through the OpenAI API only. Without
--only, such a run selects just the endpoint.* checks; without --endpoint, those checks are left out of a parity
run (they need a server). `--endpoint self` starts this package's own server on 127.0.0.1 for the target.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from k3verify.endpoint.client import EndpointError, Limits
from k3verify.endpoint.local import SELF, serve_locally
from k3verify.endpoint.probe import SetupError
from k3verify.endpoint.session import EndpointSession, open_session
from k3verify.endpoint.transfer import DEFAULT_MAX_RESPONSE_BYTES
from k3verify.errors import UsageError
from k3verify.gates.core.check import Check, CheckContext, Result, SkipCheck, Status
from k3verify.gates.core.suite import ENDPOINT_PREFIX
from k3verify.gates.shared.endpoint_common import TOP_K, greedy_answers
from k3verify.gates.shared.explain import explain
from k3verify.oracle.conventions import parse_assignment
from k3verify.target import Target, TargetError

PREFIX = ENDPOINT_PREFIX
SELF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
OUTPUT_CHECKS = ("endpoint.greedy.tokens", "endpoint.logprobs.topk", "endpoint.logprobs.prompt")


def register_endpoint_args(p: argparse.ArgumentParser) -> None:
    """The endpoint flags; `--dtype` (shared with local runs) is parity's own: for an endpoint it is the precision
    the endpoint computes in, the logprob bars and near-tie margins are measured with the oracle at it."""
    g = p.add_argument_group("endpoint (verify a running server)")
    g.add_argument("--endpoint", metavar="URL", help="an OpenAI-compatible server (http://host:port[/v1]); "
                   "`self` serves this package's own engine for the target on 127.0.0.1")
    g.add_argument("--model", metavar="NAME", help="the served model name (default: the first in /v1/models)")
    g.add_argument("--api-key", metavar="KEY", help="sent as `Authorization: Bearer KEY`")
    g.add_argument("--concurrency", type=int, default=4, metavar="N", help="requests in flight at most (default 4)")
    g.add_argument("--max-requests", type=int, default=400, metavar="N",
                   help="requests sent at most, retries included (default 400)")
    g.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="per request, seconds: the whole exchange (connect, retries, the full answer) ends by then "
                        "(default 120)")
    g.add_argument("--run-timeout", type=float, default=3600.0, metavar="S",
                   help="all requests of the run end by then, seconds (default 3600)")
    g.add_argument("--max-response-bytes", type=int, default=DEFAULT_MAX_RESPONSE_BYTES, metavar="N",
                   help=f"an answer longer than this is refused unread (default {DEFAULT_MAX_RESPONSE_BYTES})")
    g.add_argument("--accept-convention", action="append", default=[], metavar="NAME=VALUE",
                   help="evaluate the oracle with this known alternative convention (docs/conventions.md), an "
                        "explicit acceptance the report lists first (repeatable)")
    g.add_argument("--excuse-rounding-ties", action="store_true",
                   help="let the logprob checks excuse up to 4 rounding near-ties of an emulated precision per "
                        "sequence (docs/conventions.md), each named: an explicit acceptance like "
                        "--accept-convention, off by default because a small real deviation can hide behind it")
    g.add_argument("--explain", action=argparse.BooleanOptionalAction, default=None,
                   help="rank the catalog's conventions by how much of the endpoint's distance each explains "
                        "(default: when an output check fails)")
    g.add_argument("--endpoint-note", metavar="TEXT",
                   help="recorded in the report: how the server was started (its command line, numerics)")


def select_endpoint_checks(checks: list[Check], args: argparse.Namespace) -> list[Check]:
    """Without --endpoint, drop the endpoint checks (refusing an --only that selected nothing else); with it and
    no --only, keep only them."""
    ours = [c for c in checks if c.id.startswith(PREFIX)]
    if args.endpoint is None:
        for flag in ("model", "api_key", "endpoint_note", "explain"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} applies to --endpoint runs only")
        if args.accept_convention:
            raise UsageError("--accept-convention applies to --endpoint runs only: it changes the oracle an "
                             "endpoint is judged by, never this package's own gates")
        rest = [c for c in checks if not c.id.startswith(PREFIX)]
        if ours and not rest:
            raise UsageError(f"--only selects only endpoint checks ({', '.join(c.id for c in ours[:3])}), which need "
                             "--endpoint URL (or --endpoint self)")
        return rest
    if not ours:
        raise UsageError("--endpoint given but no endpoint check is selected (see --list)")
    return checks if args.only else ours


def _limits(args: argparse.Namespace) -> Limits:
    try:
        return Limits(concurrency=args.concurrency, max_requests=args.max_requests, timeout_s=args.timeout,
                      run_timeout_s=args.run_timeout, max_response_bytes=args.max_response_bytes)
    except ValueError as exc:
        raise UsageError(f"endpoint limits: {exc}") from exc


@contextmanager
def endpoint_session(args: argparse.Namespace, target: Target, device: torch.device) -> \
        Iterator[EndpointSession | None]:
    """The session for --endpoint (None without it); `self` serves the target here for the run's duration."""
    if args.endpoint is None:
        yield None
        return
    dtype = args.dtype or "bfloat16"
    with ExitStack() as stack:
        url, note = args.endpoint, args.endpoint_note or ""
        try:
            tokenizer = target.tokenizer()
            if url == SELF:
                if dtype not in SELF_DTYPES:
                    raise ValueError(f"--endpoint self serves in {' or '.join(SELF_DTYPES)}, not {dtype}")
                url = stack.enter_context(serve_locally(target, SELF_DTYPES[dtype], device))
                note = f"--endpoint self: k3verify's own server for {target.name} in {dtype} on {device}" + (
                    f"; {note}" if note else "")
            plain = tokenizer.num_base_tokens
            session = open_session(url, vocab=tokenizer, probe_prompt=[(97 * k + 11) % plain for k in range(1, 6)],
                                   eos_token=min(target.cfg.eos_token_ids), dtype=dtype, model=args.model,
                                   api_key=args.api_key, limits=_limits(args), note=note,
                                   accepted=[parse_assignment(a, target.cfg) for a in args.accept_convention],
                                   excuse_roundings=args.excuse_rounding_ties)
        except (SetupError, EndpointError, TargetError, ValueError) as exc:
            raise UsageError(f"--endpoint {args.endpoint}: {exc}") from exc
        stack.callback(session.client.close)
        yield session


def explain_endpoint(args: argparse.Namespace, results: list[Result], ctx: CheckContext) -> dict[str, Any] | None:
    """The catalog's conventions ranked against the endpoint's answers (gates/shared/explain.py): with --explain, or by
    default when an output check failed; None when not asked or nothing can be explained."""
    failed = [r.id for r in results if r.id in OUTPUT_CHECKS and r.status in (Status.FAIL, Status.VACUOUS)]
    session = ctx.endpoint
    if session is None or args.explain is False or (args.explain is None and not failed):
        return None
    try:
        answers = greedy_answers(ctx)
        k = min([TOP_K, *(len(s.top) for g in answers for s in g.answer.steps[: len(g.tokens)] if s.top)])
        found = explain(ctx, answers, session.accepted, session.precision, k)
    except (SkipCheck, ValueError) as exc:
        return {"headline": f"not explained: {exc}", "failed_checks": failed}
    out = found.as_dict()
    out["failed_checks"] = failed
    return out
