"""The engine side of `k3verify serve`: the checkpoint read once into memory and checked against the gate, the
engine built from those bytes, and the engine's own process under the supervisor (api/supervisor.py).

Hash what you load, load what you hashed: `load_served` reads every file the checkpoint digest covers into memory
(checkpoint/snapshot.py) and compares the digest of those bytes with the one the gate report vouched for. The
config, the weights and the tokenizer (the engine's, and the bytes handed to the HTTP process) all come from that
snapshot; nothing reads the directory by path afterwards. A restarted engine process does it all again and looks
the report up again for the bytes it read, or refuses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

import torch

import k3verify
from k3verify.api.engine_link import EngineHello, EngineHost, engine_state
from k3verify.api.metrics import EngineMetrics
from k3verify.checkpoint.loader import WeightLoadError
from k3verify.commands import serve_parallel
from k3verify.commands.serve_options import ServeOptions
from k3verify.errors import UsageError
from k3verify.gates.core.binding import read_report_key, source_digest
from k3verify.gates.trust.lookup import GateWant, lookup_report
from k3verify.kernels.compile_watch import watch_compiles
from k3verify.plan.device_fit import DoesNotFit, require_plan_fits
from k3verify.serving.engine import Engine
from k3verify.serving.graphs import graphs_for
from k3verify.serving.health import HealthPolicy
from k3verify.serving.parallel.world import ServingWorld
from k3verify.serving.prefill_graphs import prefill_graphs_for
from k3verify.serving.prefix_reuse import PrefixSettings
from k3verify.serving.runner import ModelRunner, build_runner
from k3verify.serving.spec.policy import CostPolicy, SpecPolicy
from k3verify.serving.spec.step import SpeculativeStep, build_speculative_step
from k3verify.serving.warmup import warm_up
from k3verify.target import SERVING_DTYPES, ServedCheckpoint, Target, TargetError, TokenizerBytes, snapshot_target
from k3verify.tokenizer import KimiTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatedTarget:
    """A target together with the report that vouches for it."""

    target: Target
    report: Path


@dataclass
class BuiltEngine:
    """An engine built from one snapshot: the engine, its tokenizer, that tokenizer's bytes (for a front end), and
    under a parallel layout the serving world whose rank 0 runs it (closed after the engine stops)."""

    engine: Engine
    tokenizer: KimiTokenizer
    tokenizer_bytes: TokenizerBytes
    target: Target
    world: ServingWorld | None = None

    def close(self) -> None:
        """Stop the engine, then the other ranks of its world."""
        self.engine.stop()
        if self.world is not None:
            self.world.close()


def health_policy(opts: ServeOptions) -> HealthPolicy:
    try:
        return HealthPolicy(max_nonfinite=opts.nonfinite_threshold, max_restarts=opts.max_restarts,
                            window_s=opts.health_window)
    except ValueError as exc:
        raise UsageError(f"--nonfinite-threshold / --max-restarts / --health-window: {exc}") from exc


def report_key(opts: ServeOptions) -> bytes | None:
    if opts.report_key is None:
        return None
    try:
        return read_report_key(opts.report_key)
    except ValueError as exc:
        raise UsageError(f"--report-key: {exc}") from exc


def gate_want(opts: ServeOptions, target: Target) -> GateWant:
    """What a report must name to vouch for serving `target` with these flags."""
    try:
        device_kind = torch.device(opts.device).type
    except RuntimeError as exc:
        raise UsageError(f"--device {opts.device!r}: {exc}") from exc
    return GateWant(target.digest, k3verify.__version__, device_kind, opts.dtype, source_digest(), target.preset,
                    report_key(opts), max_age_s=opts.max_report_age * 86400)


def load_served(opts: ServeOptions, gated: GatedTarget, *, recheck: bool = False) -> ServedCheckpoint:
    """The gated checkpoint read once into memory; UsageError unless those bytes have the digest the gate vouched
    for (with `recheck`, the report dir is searched again for a report that still passes for them)."""
    try:
        served = snapshot_target(gated.target)
    except TargetError as exc:
        raise UsageError(f"cannot serve: {exc}") from exc
    digest = served.target.digest
    if digest != gated.target.digest:
        raise UsageError(f"refusing to serve: {gated.target.checkpoint_dir} changed after the gate checked it: the "
                         f"bytes read to serve have digest {digest}, the gate report {gated.report} vouches for "
                         f"{gated.target.digest}")
    if recheck:
        found = lookup_report(opts.report_dir, gate_want(opts, served.target))
        if found.passing is None:
            raise UsageError(f"refusing to serve {gated.target.checkpoint_dir}: no passing gate report for the bytes "
                             f"read now ({found.reason})")
    return served


def build_served(opts: ServeOptions, gated: GatedTarget, *, recheck: bool = False) -> BuiltEngine:
    """The engine of a gated target, built from one snapshot of its directory (weights, config, tokenizer)."""
    served = load_served(opts, gated, recheck=recheck)
    target = served.target
    try:
        tokenizer_bytes = served.tokenizer_bytes()
        tokenizer = served.tokenizer()
    except TargetError as exc:
        raise UsageError(str(exc)) from exc
    sizes = (("num_pages", opts.num_pages), ("page_size", opts.page_size))
    cache_kw: dict[str, Any] = {k: v for k, v in sizes if v is not None}
    layout = serve_parallel.layout_of(opts)
    if layout.world > 1 and opts.speculative is not None:
        raise UsageError(f"--speculative with {layout.describe()}: the score step is not replayed on the other "
                         "ranks yet; serve a parallel layout without speculative decoding")
    if opts.prefill_graphs and (torch.device(opts.device).type != "cuda" or layout.world > 1):
        raise UsageError(f"--prefill-graphs needs one CUDA device (got --device {opts.device}, {layout.describe()}): "
                         "CUDA graphs over collectives are not captured yet")
    graphs = prefill_graphs = world = None
    try:
        if layout.world > 1:  # rank 0 runs the engine here; each rank checks its own snapshot's digest
            world = serve_parallel.start_world(target, opts, layout)
            runner: ModelRunner = world.runner  # decodes eagerly: no graphs over collectives yet
        else:
            context = (opts.num_pages or 256) * (opts.page_size or 16)
            require_plan_fits(target.cfg, f"serve --dtype {opts.dtype}", context=context, batch=opts.max_batch,
                              segment=opts.max_step_tokens, dtype=SERVING_DTYPES[opts.dtype], device=opts.device,
                              hint="fewer --num-pages or --max-batch, --dtype bfloat16, or more GPUs (--tp/--ep)")
            runner = build_runner(target.cfg, served.weights(), dtype=SERVING_DTYPES[opts.dtype],
                                  device=torch.device(opts.device), num_slots=opts.max_batch, **cache_kw)
            graphs = graphs_for(runner.model, runner.max_context, runner.state_pool.num_slots)
            if opts.prefill_graphs:
                prefill_graphs = prefill_graphs_for(runner.model, opts.max_step_tokens, runner.state_pool.num_slots)
    except DoesNotFit as exc:
        raise UsageError(str(exc)) from None
    except WeightLoadError as exc:
        raise UsageError(f"cannot serve {target.checkpoint_dir}: {exc}") from exc
    served.snapshot.drop_shards()  # the model holds its own copy now
    _prefix_cache(opts, runner, target, layout.world)
    engine = Engine(runner, tokenizer, eos_token_ids=target.cfg.eos_token_ids, vocab_size=target.cfg.vocab_size,
                    max_step_tokens=opts.max_step_tokens, graphs=graphs, debug=opts.debug,
                    health_policy=health_policy(opts), admit_quiet_s=opts.admit_quiet_ms / 1e3,
                    admit_max_hold_s=opts.admit_max_hold_ms / 1e3,
                    speculator=_speculator(opts, runner), prefill_graphs=prefill_graphs)
    return BuiltEngine(engine, tokenizer, tokenizer_bytes, target, world)


def _prefix_cache(opts: ServeOptions, runner: ModelRunner, target: Any, world: int) -> None:
    """On unless --no-prefix-cache, on one rank: a parallel world's ranks do not replay the snapshots yet."""
    if opts.no_prefix_cache:
        return
    if opts.prefix_snapshots < 0:
        raise UsageError(f"--prefix-snapshots must be >= 0; got {opts.prefix_snapshots}")
    if world > 1:
        log.warning("prefix cache off: %d ranks do not replay its snapshots yet (serve on one rank to reuse prefixes)",
                    world)
        return
    runner.enable_prefix_cache(target.digest, target.cfg.vocab_size,
                               PrefixSettings(snapshots=opts.prefix_snapshots, per_key=opts.prefix_cache_per_key))


def _speculator(opts: ServeOptions, runner: ModelRunner) -> SpeculativeStep | None:
    if opts.speculative is None:
        if opts.kda_fused_score:
            raise UsageError("--kda-fused-score (--kda-fused-verify) only applies with --speculative")
        return None
    try:
        policy = SpecPolicy(min_mean_accepted=opts.spec_min_accept)
        step = build_speculative_step(runner, opts.speculative, opts.num_draft, opts.max_batch,
                                      fused=opts.kda_fused_score, policy=policy,
                                      cost_policy=None if opts.no_spec_cost_policy else CostPolicy())
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    path = "fused (one launch per layer where the kernel accepts the geometry)" if opts.kda_fused_score else "unfused"
    print(f"k3verify serve: speculative decoding with the {opts.speculative} drafter, k={opts.num_draft}, "
          f"KDA score {path}", flush=True)
    return step


def warm_up_if_cuda(opts: ServeOptions, built: BuiltEngine) -> None:
    # a parallel world's ranks replay rank 0's steps through the engine loop only: no warm-up outside it
    engine = built.engine
    if engine.runner.device.type != "cuda":
        return
    watch_compiles(lambda line: print(f"k3verify serve: {line}", flush=True))
    if not opts.no_warmup and built.world is None:
        report = warm_up(engine.runner, engine.launcher.graphs, opts.max_step_tokens, engine.launcher.prefill_graphs)
        print(f"k3verify serve: {report.describe()}", flush=True)


def _serve_links(listener: Listener, engine: Engine, metrics: EngineMetrics, hello: EngineHello) -> None:
    """One front end at a time: a new connection (a restarted front end) replaces the last one's link."""
    host: EngineHost | None = None
    while True:
        try:
            conn = listener.accept()
        except (AuthenticationError, EOFError):
            continue  # not our front end (wrong key) or it left mid-handshake
        except OSError:
            return  # the listener was closed: the process is stopping
        if host is not None:
            host.close()
        host = EngineHost(engine, conn, metrics.render, hello).start()


def engine_main(fd: int) -> int:
    """The engine's process under `serve`'s supervisor: FD is its control connection, whose first message is
    ("start", opts, gated, address, authkey, restarts so far); it answers ("ready", pid), ("refused", why) (exit 2:
    the checkpoint or its report no longer vouch) or ("failed", why), then serves front ends on `address` until told
    to stop or the supervisor is gone."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: [engine %(process)d] %(name)s: %(message)s")
    control = Connection(fd)
    _, opts, gated, address, authkey, restarts = control.recv()
    try:
        built = build_served(opts, gated, recheck=True)
        warm_up_if_cuda(opts, built)
    except UsageError as exc:
        control.send(("refused", str(exc)))
        return 2
    except Exception as exc:
        log.exception("the engine could not be built")
        control.send(("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    engine, metrics = built.engine, EngineMetrics()
    engine.observer = metrics
    if restarts:  # a process the supervisor restarted: /health and the restart counter say so
        engine.health_tracker.record_process_restarts(restarts, "the engine's process died and the supervisor "
                                                                "restarted it")
        metrics.restarts.inc(restarts)
    metrics.watch_prefix_cache(lambda: engine.runner.prefix)
    engine.start()
    hello = EngineHello(engine.limits, engine_state(engine), built.tokenizer_bytes.load, built.target.digest)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)  # a killed predecessor's socket file
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    threading.Thread(target=_serve_links, args=(listener, engine, metrics, hello), name="k3verify-links",
                     daemon=True).start()
    control.send(("ready", os.getpid()))
    try:
        control.recv()  # ("stop",), or EOF: the supervisor is gone
    except (EOFError, OSError):
        pass
    finally:
        listener.close()
        built.close()
    return 0
