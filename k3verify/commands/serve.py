"""`k3verify serve`: an OpenAI-compatible server that starts only behind a passing gate report.

The gate is checked before any weight is loaded: no report.json under --report-dir bound to this exact
checkpoint digest, k3verify version and source, device kind and served dtype, whose recomputed verdict is
pass (and, with --report-key, whose signature verifies) means exit 2 and a message naming the
`k3verify parity` command to run (or `--run-gates` runs the quick suite first). gates/report_lookup.py.
"""

from __future__ import annotations

import argparse
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import torch

import k3verify
from k3verify.checkpoint.digest import checkpoint_digest
from k3verify.cli import Subparsers, UsageError
from k3verify.commands import parity, serve_parallel
from k3verify.gates.binding import read_report_key, source_digest
from k3verify.gates.report_lookup import GateWant, lookup_report
from k3verify.server.app import create_app
from k3verify.server.engine_link import ApiProcess, ApiStartError, api_config
from k3verify.server.metrics import EngineMetrics, ServerMetrics
from k3verify.server.thread import describe_server_impl
from k3verify.serving.engine import ADMIT_MAX_HOLD_S, ADMIT_QUIET_S, Engine
from k3verify.serving.graphs import graphs_for
from k3verify.serving.health import HealthPolicy
from k3verify.serving.prefill_graphs import prefill_graphs_for
from k3verify.serving.runner import ModelRunner, build_runner
from k3verify.serving.spec.policy import CostGate, SpecPolicy
from k3verify.serving.spec.step import SPEC_DRAFTERS, SpeculativeStep, build_speculative_step
from k3verify.serving.warmup import warm_up
from k3verify.target import DEFAULT_PRESET, DEFAULT_REPORT_DIR, Target, TargetError, resolve_target
from k3verify.tokenizer import KimiTokenizer

log = logging.getLogger(__name__)




def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (gated)",
                              description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME", help=f"synthetic preset (default {DEFAULT_PRESET})")
    src.add_argument("--checkpoint", metavar="DIR", type=Path, help="a checkpoint directory with config.json")
    p.add_argument("--report-dir", type=Path, default=DEFAULT_REPORT_DIR, metavar="DIR",
                   help=f"where gate reports are searched, recursively (default {DEFAULT_REPORT_DIR})")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", metavar="KEY", help="require `Authorization: Bearer KEY` on /v1/*")
    p.add_argument("--report-key", type=Path, metavar="FILE",
                   help="only reports signed with this key (parity --report-key) count; edited reports are refused")
    p.add_argument("--run-gates", action="store_true", help="run the quick parity suite first if no report passes")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda")
    p.add_argument("--dtype", choices=tuple(parity.SERVING_DTYPES), default="bfloat16",
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
                        "sequences, longest prompt), captured on a bucket's second use (default off: not yet "
                        "measured on the H200)")
    p.add_argument("--debug", action="store_true", help="check cache integrity after every engine step")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the start-up warm-up on CUDA (decode graphs of every bucket captured and a ladder of "
                        "prefill sizes run before the port opens, so no first request pays Triton compiles)")
    p.add_argument("--nonfinite-threshold", type=int, default=HealthPolicy.max_nonfinite, metavar="N",
                   help="requests failed by non-finite logits within --health-window after which /health answers "
                        f"503 (default {HealthPolicy.max_nonfinite}; fewer make it 'degraded')")
    p.add_argument("--max-restarts", type=int, default=HealthPolicy.max_restarts, metavar="N",
                   help="engine restarts within --health-window before the supervisor gives up "
                        f"(default {HealthPolicy.max_restarts})")
    p.add_argument("--health-window", type=float, default=HealthPolicy.window_s, metavar="SECONDS",
                   help=f"the window of the two counts above (default {HealthPolicy.window_s:g})")
    p.add_argument("--speculative", choices=SPEC_DRAFTERS, default=None,
                   help="speculative decoding with this drafter (default: off)")
    p.add_argument("--num-draft", type=int, default=4, metavar="K", help="draft tokens per verify (with --speculative)")
    p.add_argument("--spec-min-accept", type=float, default=0.25, metavar="X",
                   help="a request stops speculating once its accepted drafts per verify fall below X (after 3)")
    p.add_argument("--no-spec-cost-gate", action="store_true",
                   help="verify whenever there are drafts (default: only when a verify step, timed here, is expected "
                        "to emit more tokens per second than a plain decode step of the same batch)")
    p.add_argument("--kda-fused-verify", action="store_true",
                   help="verify each KDA layer in one Triton launch (CUDA; default off: three launches)")
    p.add_argument("--api-in-process", action="store_true",
                   help="run the HTTP server in the engine's process (default: a process of its own, so that "
                        "request parsing and streaming do not take the engine thread's GIL)")
    serve_parallel.add_flags(p)
    p.set_defaults(func=run_serve)


@dataclass(frozen=True)
class GatedTarget:
    """A target together with the report that vouches for it."""

    target: Target
    report: Path


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{name} must be >= 1; got {value}")


def health_policy(args: argparse.Namespace) -> HealthPolicy:
    try:
        return HealthPolicy(max_nonfinite=args.nonfinite_threshold, max_restarts=args.max_restarts,
                            window_s=args.health_window)
    except ValueError as exc:
        raise UsageError(f"--nonfinite-threshold / --max-restarts / --health-window: {exc}") from exc


def parity_command(args: argparse.Namespace) -> str:
    if args.checkpoint is not None:
        src = f"--checkpoint {args.checkpoint}"
    else:
        src = f"--preset {args.preset or DEFAULT_PRESET}"
    device = "" if args.device == "cpu" else f" --device {args.device}"
    dtype = "" if args.dtype == "bfloat16" else f" --dtype {args.dtype}"
    layout = " ".join(serve_parallel.parity_flags(serve_parallel.layout_of(args)))
    return f"k3verify parity {src}{device}{dtype}{' ' + layout if layout else ''} --report-dir {args.report_dir}"


def run_gates(args: argparse.Namespace) -> int:
    """The quick parity suite, through the parity command's own parser and function."""

    parser = argparse.ArgumentParser(prog="k3verify")
    parity.register(parser.add_subparsers(dest="command"))
    argv = ["parity", "--suite", "quick", "--device", args.device, "--dtype", args.dtype,
            "--report-dir", str(args.report_dir)]
    argv += ["--checkpoint", str(args.checkpoint)] if args.checkpoint is not None else \
        ["--preset", args.preset or DEFAULT_PRESET]
    argv += ["--report-key", str(args.report_key)] if args.report_key is not None else []
    argv += serve_parallel.parity_flags(serve_parallel.layout_of(args))
    pargs = parser.parse_args(argv)
    return int(pargs.func(pargs))


def report_key(args: argparse.Namespace) -> bytes | None:
    if args.report_key is None:
        return None
    try:
        return read_report_key(args.report_key)
    except ValueError as exc:
        raise UsageError(f"--report-key: {exc}") from exc


def target_for(args: argparse.Namespace) -> Target:
    try:
        return resolve_target(args.preset, args.checkpoint)
    except TargetError as exc:
        raise UsageError(f"cannot serve: {exc}") from exc


def require_gate(args: argparse.Namespace) -> GatedTarget:
    """Resolve the checkpoint and find its passing report (running the gates if asked); UsageError otherwise."""
    for name in ("max_batch", "num_pages", "page_size", "max_step_tokens"):
        _positive(f"--{name.replace('_', '-')}", getattr(args, name))
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key must not be empty (an empty key would accept an empty bearer token); "
                         "leave it out to serve without authentication on loopback")
    health_policy(args)
    if args.admit_quiet_ms < 0 or args.admit_max_hold_ms < 0:
        raise UsageError(f"--admit-quiet-ms and --admit-max-hold-ms must be >= 0; got {args.admit_quiet_ms}, "
                         f"{args.admit_max_hold_ms}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535; got {args.port}")
    try:
        device_kind = torch.device(args.device).type
    except RuntimeError as exc:
        raise UsageError(f"--device {args.device!r}: {exc}") from exc
    key = report_key(args)
    target = target_for(args)
    want = GateWant(target.digest, k3verify.__version__, device_kind, args.dtype, source_digest(), target.preset,
                    key)
    found = lookup_report(args.report_dir, want)
    if found.passing is None and args.run_gates:
        print(f"k3verify serve: {found.reason}; running the quick gate suite ...", flush=True)
        code = run_gates(args)
        found = lookup_report(args.report_dir, want)
        if found.passing is None:
            raise UsageError(f"the gates did not pass (parity exit code {code}): {found.reason}. "
                             f"Refusing to serve; see the report under {args.report_dir}")
    if found.passing is None:
        raise UsageError(f"refusing to serve: no passing gate report under {args.report_dir} "
                         f"({found.reason}). Run `{parity_command(args)}` first, or pass --run-gates")
    layout = serve_parallel.layout_of(args)
    why = serve_parallel.dist_gate_reason(found.passing, layout) if layout.world > 1 else None
    if why is not None:
        raise UsageError(f"refusing to serve with {layout.describe()}: {why}. Run `{parity_command(args)}` first")
    return GatedTarget(target, found.passing)


def build_engine(args: argparse.Namespace, gated: GatedTarget) -> tuple[Engine, KimiTokenizer]:
    """(engine, tokenizer) for a gated target: weights, runner, the checkpoint's own tokenizer."""
    target = gated.target
    try:
        tokenizer = target.tokenizer()
    except TargetError as exc:
        raise UsageError(str(exc)) from exc
    cache_kw = {k: v for k, v in (("num_pages", args.num_pages), ("page_size", args.page_size)) if v is not None}
    layout = serve_parallel.layout_of(args)
    if layout.world > 1 and args.speculative is not None:
        raise UsageError(f"--speculative with {layout.describe()}: the verify step is not replayed on the other "
                         "ranks yet; serve a parallel layout without speculative decoding")
    if args.prefill_graphs and (torch.device(args.device).type != "cuda" or layout.world > 1):
        raise UsageError(f"--prefill-graphs needs one CUDA device (got --device {args.device}, {layout.describe()}): "
                         "CUDA graphs over collectives are not captured yet")
    graphs = prefill_graphs = None
    if layout.world > 1:  # rank 0 runs the engine here; ServingWorld.close() is run_serve's to call
        args.serving_world = serve_parallel.start_world(target, args, layout)
        runner: ModelRunner = args.serving_world.runner  # decodes eagerly: no graphs over collectives yet
    else:
        runner = build_runner(target.cfg, target.weights(), dtype=parity.SERVING_DTYPES[args.dtype],
                              device=torch.device(args.device), num_slots=args.max_batch, **cache_kw)
        graphs = graphs_for(runner.model, runner.max_context, runner.state_pool.num_slots)
        if args.prefill_graphs:
            prefill_graphs = prefill_graphs_for(runner.model, args.max_step_tokens, runner.state_pool.num_slots)
    if checkpoint_digest(target.checkpoint_dir) != target.digest:  # cheap when unchanged: per-file hashes cached
        raise UsageError(f"refusing to serve: {target.checkpoint_dir} changed while its weights were loaded "
                         "(its digest no longer matches the gated one)")
    engine = Engine(runner, tokenizer, eos_token_ids=target.cfg.eos_token_ids, vocab_size=target.cfg.vocab_size,
                    max_step_tokens=args.max_step_tokens, graphs=graphs, debug=args.debug,
                    health_policy=health_policy(args), admit_quiet_s=args.admit_quiet_ms / 1e3,
                    admit_max_hold_s=args.admit_max_hold_ms / 1e3,
                    speculator=_speculator(args, runner), prefill_graphs=prefill_graphs)
    return engine, tokenizer


def _speculator(args: argparse.Namespace, runner: ModelRunner) -> SpeculativeStep | None:
    if args.speculative is None:
        if args.kda_fused_verify:
            raise UsageError("--kda-fused-verify only applies with --speculative")
        return None
    try:
        policy = SpecPolicy(min_mean_accepted=args.spec_min_accept)
        step = build_speculative_step(runner, args.speculative, args.num_draft, args.max_batch,
                                      fused=args.kda_fused_verify, policy=policy,
                                      gate=None if args.no_spec_cost_gate else CostGate())
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    path = "fused (one launch per layer where the kernel accepts the geometry)" if args.kda_fused_verify else "unfused"
    print(f"k3verify serve: speculative decoding with the {args.speculative} drafter, k={args.num_draft}, "
          f"KDA verify {path}", flush=True)
    return step


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def serve_from_api_process(args: argparse.Namespace, engine: Engine, target: Target) -> None:
    """The engine here, uvicorn and the app in a process of their own (server/engine_link.py), until that process
    exits (SIGINT / SIGTERM) or this one is interrupted."""
    observer = EngineMetrics()
    engine.observer = observer
    config = api_config(engine.start(), target.tokenizer_loader(),
                        target.name, host=args.host, port=args.port, api_key=args.api_key, log_level="info")
    signal.signal(signal.SIGTERM, _interrupt)  # stop the API process on the way out, as on SIGINT
    api = ApiProcess(engine, config, observer.render)
    try:
        api.__enter__()
    except ApiStartError as exc:  # a port in use, say: the user's to fix, named
        raise UsageError(f"cannot serve on {args.host}:{args.port}: {exc}") from None
    try:
        print(f"k3verify serve: {api.url}/v1 (model {target.name!r}); {describe_server_impl()}, in its own "
              "process", flush=True)
        try:
            code = api.wait()
        except KeyboardInterrupt:  # the API process got the terminal's SIGINT too; __exit__ stops it
            return
        if code not in (0, -signal.SIGINT, -signal.SIGTERM):
            log.error("the API server process exited with code %d", code)
    finally:
        api.__exit__(None, None, None)


def serve_in_process(args: argparse.Namespace, engine: Engine, tokenizer: KimiTokenizer, model_name: str) -> None:
    """Engine and uvicorn in this process (--api-in-process): one GIL for both."""
    import uvicorn

    metrics = ServerMetrics()
    engine.observer = metrics
    app = create_app(engine.start(), tokenizer, model_name=model_name, api_key=args.api_key, metrics=metrics)
    print(f"k3verify serve: http://{args.host}:{args.port}/v1 (model {model_name!r}); {describe_server_impl()}, "
          "in the engine's process", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


def run_serve(args: argparse.Namespace) -> int:
    gated = require_gate(args)
    target = gated.target
    print(f"k3verify serve: gate report {gated.report} vouches for {target.name} ({target.digest})", flush=True)
    engine, tokenizer = build_engine(args, gated)
    # a parallel world's ranks replay rank 0's steps through the engine loop only: no warm-up outside it
    if engine.runner.device.type == "cuda" and not args.no_warmup and getattr(args, "serving_world", None) is None:
        report = warm_up(engine.runner, engine.launcher.graphs, args.max_step_tokens, engine.launcher.prefill_graphs)
        print(f"k3verify serve: {report.describe()}", flush=True)
    try:
        if args.api_in_process:
            serve_in_process(args, engine, tokenizer, target.name)
        else:
            serve_from_api_process(args, engine, target)
    finally:
        engine.stop()
        if getattr(args, "serving_world", None) is not None:
            args.serving_world.close()
    return 0 if engine.health() in (None, "engine stopped") else 1
