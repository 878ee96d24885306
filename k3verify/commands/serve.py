"""`k3verify serve`: an OpenAI-compatible server that starts only behind a passing gate report.

The gate is checked before any weight is loaded: no report.json under --report-dir bound to this exact
checkpoint digest, k3verify version and source, device kind and served dtype, whose recomputed verdict is
pass (and, with --report-key, whose signature verifies) means exit 2 and a message naming the
`k3verify parity` command to run (or `--run-gates` runs the quick suite first). gates/trust/lookup.py.
The engine is then built from one in-memory snapshot of the checkpoint whose digest must be the gated one
(commands/serve_engine.py); by default it runs in a process of its own beside the HTTP front end's, both under a
supervisor that restarts either (api/supervisor.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from k3verify.api.api_process import FrontEndConfig, bind
from k3verify.api.app import api_key_problem, create_app
from k3verify.api.hosts import HostNameError, allowed_hosts, only_loopback
from k3verify.api.metrics import ServerMetrics
from k3verify.api.supervisor import Child, ChildError, Supervisor
from k3verify.api.thread import describe_server_impl
from k3verify.commands import Subparsers, parity, serve_parallel
from k3verify.commands.serve_engine import (
    GatedTarget,
    build_served,
    gate_want,
    health_policy,
    report_key,
    warm_up_if_cuda,
)
from k3verify.commands.serve_options import ServeOptions
from k3verify.errors import UsageError
from k3verify.gates.trust.lookup import DEFAULT_MAX_AGE_DAYS, lookup_report
from k3verify.serving.engine import ADMIT_MAX_HOLD_S, ADMIT_QUIET_S, Engine
from k3verify.serving.health import HealthPolicy
from k3verify.serving.prefix_reuse import DEFAULT_SNAPSHOTS
from k3verify.serving.spec.step import SPEC_DRAFTERS
from k3verify.target import DEFAULT_PRESET, DEFAULT_REPORT_DIR, SERVING_DTYPES, Target, TargetError, resolve_target
from k3verify.tokenizer import KimiTokenizer

__all__ = ["GatedTarget", "build_engine", "register", "require_gate", "run_serve"]

log = logging.getLogger(__name__)
UNSIGNED_NOTE = ("Without --report-key, an edit of a report or of its index line is refused, but whoever can write "
                 "under the report dir can still write a new, consistent report of their own, or delete a newer "
                 "failing one with its index; --report-key stops the first (docs/serving.md, Threat model)")


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (gated)",
                              description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME", help=f"synthetic preset (default {DEFAULT_PRESET})")
    src.add_argument("--checkpoint", metavar="DIR", type=Path, help="a checkpoint directory with config.json")
    p.add_argument("--report-dir", type=Path, default=DEFAULT_REPORT_DIR, metavar="DIR",
                   help=f"where gate reports are searched, recursively (default {DEFAULT_REPORT_DIR})")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header names NAME (repeatable); by default only loopback "
                        "names and the --host value are answered, anything else gets 421 (DNS rebinding). With "
                        "--host 0.0.0.0, list the names and addresses clients use")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", metavar="KEY", help="require `Authorization: Bearer KEY` on /v1/* (visible in `ps`: "
                   "prefer --api-key-file or the K3V_API_KEY environment variable)")
    p.add_argument("--api-key-file", type=Path, metavar="FILE", help="the API key, read from FILE's first line")
    p.add_argument("--max-report-age", type=float, default=DEFAULT_MAX_AGE_DAYS, metavar="DAYS",
                   help=f"refuse a passing gate report whose run started longer ago (default {DEFAULT_MAX_AGE_DAYS:g})")
    p.add_argument("--report-key", type=Path, metavar="FILE",
                   help="only reports signed with this key (parity --report-key) count; edited reports are refused")
    p.add_argument("--run-gates", action="store_true", help="run the quick parity suite first if no report passes")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda")
    p.add_argument("--dtype", choices=tuple(SERVING_DTYPES), default="bfloat16",
                   help="serving dtype (default bfloat16); the gate report must have covered it")
    p.add_argument("--max-batch", type=int, default=8, metavar="N", help="sequence slots in the caches")
    p.add_argument("--num-pages", type=int, default=None, metavar="N", help="MLA cache pages (default: runner's)")
    p.add_argument("--page-size", type=int, default=None, metavar="N", help="tokens per cache page")
    p.add_argument("--max-step-tokens", type=int, default=2048, metavar="N",
                   help="tokens per engine step: one per decoding sequence, the rest for prompt chunks")
    p.add_argument("--admit-quiet-ms", type=float, default=1e3 * ADMIT_QUIET_S, metavar="MS",
                   help="admit waiting requests once none has arrived for MS (default %(default)g; 0: at once): "
                        "requests arriving together share one prefill step")
    p.add_argument("--admit-max-hold-ms", type=float, default=1e3 * ADMIT_MAX_HOLD_S, metavar="MS",
                   help="... or once the oldest has waited MS (default %(default)g)")
    p.add_argument("--prefill-graphs", action="store_true",
                   help="on CUDA, replay prefills of fresh prompts from CUDA graphs captured per bucket of (tokens, "
                        "sequences, longest prompt), captured on a bucket's second use (default off: no served "
                        "speed-up measured yet)")
    p.add_argument("--debug", action="store_true", help="check cache integrity after every engine step")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt from token 0 (default: resume shared prompt prefixes from the prefix "
                        "cache, docs/prefix-caching.md; one rank only)")
    p.add_argument("--prefix-cache-per-key", action="store_true",
                   help="keep prefix-cache entries apart per bearer token (default: shared by every request)")
    p.add_argument("--prefix-snapshots", type=int, default=DEFAULT_SNAPSHOTS, metavar="N",
                   help=f"the prefix cache's snapshot budget in snapshots (default {DEFAULT_SNAPSHOTS}; "
                        "`k3verify plan --prefix-snapshots N` sizes it)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the start-up warm-up on CUDA (decode graphs of every bucket captured and a ladder of "
                        "prefill sizes run before the port opens, so no first request pays Triton compiles)")
    p.add_argument("--nonfinite-threshold", type=int, default=HealthPolicy.max_nonfinite, metavar="N",
                   help="requests failed by non-finite logits within --health-window after which /health answers "
                        f"503 (default {HealthPolicy.max_nonfinite}; fewer make it 'degraded')")
    p.add_argument("--max-restarts", type=int, default=HealthPolicy.max_restarts, metavar="N",
                   help="restarts within --health-window before the supervisor gives up: of the engine loop, and "
                        "of each process (the engine's, the HTTP front end's), counted apart "
                        f"(default {HealthPolicy.max_restarts})")
    p.add_argument("--health-window", type=float, default=HealthPolicy.window_s, metavar="SECONDS",
                   help=f"the window of the two counts above (default {HealthPolicy.window_s:g})")
    p.add_argument("--speculative", choices=SPEC_DRAFTERS, default=None,
                   help="speculative decoding with this drafter (default: off)")
    p.add_argument("--num-draft", type=int, default=4, metavar="K",
                   help="draft tokens per score pass (with --speculative)")
    p.add_argument("--spec-min-accept", type=float, default=0.25, metavar="X",
                   help="a request stops speculating once its accepted drafts per score pass fall below X (after 3)")
    p.add_argument("--no-spec-cost-policy", "--no-spec-cost-gate", action="store_true",
                   help="score whenever there are drafts (default: only when a score pass, timed here, is expected "
                        "to emit more tokens per second than a plain decode step of the same batch)")
    p.add_argument("--kda-fused-score", "--kda-fused-verify", action="store_true",
                   help="score each KDA layer in one Triton launch (CUDA; default off: three launches)")
    p.add_argument("--api-in-process", action="store_true",
                   help="run the HTTP server in the engine's process (default: a process of its own, so that "
                        "request parsing and streaming do not take the engine thread's GIL)")
    serve_parallel.add_flags(p)
    p.set_defaults(func=run_serve)


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{name} must be >= 1; got {value}")


def parity_command(opts: ServeOptions) -> str:
    if opts.checkpoint is not None:
        src = f"--checkpoint {opts.checkpoint}"
    else:
        src = f"--preset {opts.preset or DEFAULT_PRESET}"
    device = "" if opts.device == "cpu" else f" --device {opts.device}"
    dtype = "" if opts.dtype == "bfloat16" else f" --dtype {opts.dtype}"
    layout = " ".join(serve_parallel.parity_flags(serve_parallel.layout_of(opts)))
    return f"k3verify parity {src}{device}{dtype}{' ' + layout if layout else ''} --report-dir {opts.report_dir}"


def run_gates(opts: ServeOptions) -> int:
    """The quick parity suite, through the parity command's own parser and function."""

    parser = argparse.ArgumentParser(prog="k3verify")
    parity.register(parser.add_subparsers(dest="command"))
    argv = ["parity", "--suite", "quick", "--device", opts.device, "--dtype", opts.dtype,
            "--report-dir", str(opts.report_dir)]
    argv += ["--checkpoint", str(opts.checkpoint)] if opts.checkpoint is not None else \
        ["--preset", opts.preset or DEFAULT_PRESET]
    argv += ["--report-key", str(opts.report_key)] if opts.report_key is not None else []
    argv += serve_parallel.parity_flags(serve_parallel.layout_of(opts))
    pargs = parser.parse_args(argv)
    return int(pargs.func(pargs))


def target_for(opts: ServeOptions) -> Target:
    try:
        return resolve_target(opts.preset, opts.checkpoint)
    except TargetError as exc:
        raise UsageError(f"cannot serve: {exc}") from exc


def require_gate(opts: ServeOptions) -> GatedTarget:
    """Resolve the checkpoint and find its passing report (running the gates if asked); UsageError otherwise."""
    for name in ("max_batch", "num_pages", "page_size", "max_step_tokens"):
        _positive(f"--{name.replace('_', '-')}", getattr(opts, name))
    if opts.api_key is not None and not opts.api_key.strip():
        raise UsageError("--api-key must not be empty (an empty key would accept an empty bearer token); "
                         "leave it out to serve without authentication on loopback")
    problem = api_key_problem(opts.api_key)
    if problem is not None:
        raise UsageError(f"--api-key {problem}")
    hosts_for(opts)
    health_policy(opts)
    if opts.admit_quiet_ms < 0 or opts.admit_max_hold_ms < 0:
        raise UsageError(f"--admit-quiet-ms and --admit-max-hold-ms must be >= 0; got {opts.admit_quiet_ms}, "
                         f"{opts.admit_max_hold_ms}")
    if not 0 <= opts.port <= 65535:
        raise UsageError(f"--port must be in 0..65535; got {opts.port}")
    report_key(opts)
    if not opts.max_report_age > 0:
        raise UsageError(f"--max-report-age must be > 0 days; got {opts.max_report_age}")
    target = target_for(opts)
    want = gate_want(opts, target)
    found = lookup_report(opts.report_dir, want)
    if found.passing is None and opts.run_gates:
        print(f"k3verify serve: {found.reason}; running the quick gate suite ...", flush=True)
        code = run_gates(opts)
        found = lookup_report(opts.report_dir, want)
        if found.passing is None:
            raise UsageError(f"the gates did not pass (parity exit code {code}): {found.reason}. "
                             f"Refusing to serve; see the report under {opts.report_dir}")
    if found.passing is None:
        raise UsageError(f"refusing to serve: no passing gate report under {opts.report_dir} "
                         f"({found.reason}). Run `{parity_command(opts)}` first, or pass --run-gates"
                         + ("" if opts.report_key is not None else f". {UNSIGNED_NOTE}"))
    layout = serve_parallel.layout_of(opts)
    why = serve_parallel.dist_gate_reason(found.passing, layout) if layout.world > 1 else None
    if why is not None:
        raise UsageError(f"refusing to serve with {layout.describe()}: {why}. Run `{parity_command(opts)}` first")
    return GatedTarget(target, found.passing)


def build_engine(opts: ServeOptions, gated: GatedTarget) -> tuple[Engine, KimiTokenizer]:
    """(engine, tokenizer) for a gated target, built from one snapshot of its directory whose digest must be the
    gated one (commands/serve_engine.py)."""
    built = build_served(opts, gated)
    return built.engine, built.tokenizer


def hosts_for(opts: ServeOptions) -> tuple[str, ...]:
    try:
        return allowed_hosts(opts.host, opts.allowed_host)
    except HostNameError as exc:
        raise UsageError(f"--allowed-host / --host: {exc}") from None


def warn_about_wildcard_bind(opts: ServeOptions, hosts: tuple[str, ...]) -> None:
    if only_loopback(hosts) and opts.host.strip() in ("0.0.0.0", "::", "[::]"):
        log.warning("--host %s accepts connections from other machines, but the server answers only requests whose "
                    "Host header is a loopback name (421 otherwise): add the names and addresses clients use with "
                    "--allowed-host NAME (repeatable)", opts.host)


def serve_in_process(opts: ServeOptions, engine: Engine, tokenizer: KimiTokenizer, model_name: str) -> None:
    """Engine and uvicorn in this process (--api-in-process): one GIL for both, no supervisor."""
    import uvicorn

    metrics = ServerMetrics()
    engine.observer = metrics
    metrics.watch_prefix_cache(lambda: engine.runner.prefix)
    app = create_app(engine.start(), tokenizer, model_name=model_name, api_key=opts.api_key, metrics=metrics,
                     allowed_hosts=hosts_for(opts))
    print(f"k3verify serve: http://{opts.host}:{opts.port}/v1 (model {model_name!r}); {describe_server_impl()}, "
          "in the engine's process", flush=True)
    uvicorn.run(app, host=opts.host, port=opts.port, log_level="info")


def serve_supervised(opts: ServeOptions, gated: GatedTarget) -> int:
    """The engine's process and the HTTP front end's under a supervisor (this process) that restarts either."""
    hosts = hosts_for(opts)
    try:
        sock = bind(opts.host, opts.port)
    except OSError as exc:
        raise UsageError(f"cannot serve on {opts.host}:{opts.port}: {exc.strerror or exc}") from None
    workdir = tempfile.mkdtemp(prefix="k3v-serve-")  # 0700: only this user reaches the engine's socket
    address, authkey = os.path.join(workdir, "engine.sock"), os.urandom(32)
    engine = Child("engine", "k3verify.commands.serve_engine", "engine_main", ("start", opts, gated, address, authkey))
    front_config = FrontEndConfig(address, authkey, gated.target.name, api_key=opts.api_key, allowed_hosts=hosts)
    front = Child("HTTP front end", "k3verify.api.api_process", "supervised_main", ("start", front_config),
                  pass_fds=(sock.fileno(),))
    supervisor = Supervisor(engine, front, opts.max_restarts, opts.health_window)
    try:
        try:
            supervisor.start()
        except ChildError as exc:
            if exc.code == 2:
                raise UsageError(str(exc)) from None
            print(f"k3verify serve: error: {exc}", file=sys.stderr, flush=True)
            return 1
        host, port = sock.getsockname()[:2]
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        print(f"k3verify serve: {url}/v1 (model {gated.target.name!r}); {describe_server_impl()}, in its own process "
              f"(pid {front.pid}) beside the engine's (pid {engine.pid}), under a supervisor (pid {os.getpid()})",
              flush=True)
        return supervisor.run()
    finally:
        sock.close()
        shutil.rmtree(workdir, ignore_errors=True)


def run_serve(args: argparse.Namespace) -> int:
    opts = ServeOptions.from_args(args)
    gated = require_gate(opts)
    target = gated.target
    print(f"k3verify serve: gate report {gated.report} vouches for {target.name} ({target.digest})", flush=True)
    warn_about_wildcard_bind(opts, hosts_for(opts))
    if not opts.api_in_process:
        return serve_supervised(opts, gated)
    built = build_served(opts, gated)
    warm_up_if_cuda(opts, built)
    try:
        serve_in_process(opts, built.engine, built.tokenizer, target.name)
    finally:
        built.close()
    return 0 if built.engine.health() in (None, "engine stopped") else 1
