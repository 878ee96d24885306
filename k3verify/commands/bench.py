"""`k3verify bench`: GPU speed of our serving model against transformers+fla, with parity in the same run."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3verify.commands import Subparsers
from k3verify.errors import UsageError
from k3verify.target import ModelShape, TargetError, resolve_shape

if TYPE_CHECKING:  # bench code imports CUDA-side modules lazily: `--table` runs without them
    from k3verify.bench.run import BenchResult

PARITY_BAR = 5e-3  # --parity-bar's default (the kl bench's floor under 1.5x the baseline's distance)


def register(sub: Subparsers) -> None:
    p = sub.add_parser("bench", help="GPU only: our prefill/decode speed vs transformers+fla (same run)")
    p.add_argument("--preset", default=None, help="default kl-48b-8l (k3-slice-4l with --mxfp4)")
    p.add_argument("--checkpoint", type=Path, default=None, metavar="DIR",
                   help="bench this checkpoint's shape (its config.json); the weights are generated name-seeded on "
                        "the GPU as for a preset, not read from DIR")
    p.add_argument("--prefill", default=None, help="prompt lengths for the prefill measurement "
                   "(default 1024,8192; 8192 with --mxfp4)")
    p.add_argument("--batch", default=None, help="decode batch sizes (default 1,16,64; 1,64 with --mxfp4)")
    p.add_argument("--mxfp4", action="store_true", help="MXFP4 experts served packed vs dequantized to bf16 "
                   "(weights memory, MoE layer, decode, prefill; parity vs an fp32 gold in the same run)")
    p.add_argument("--moe-tokens", default="1,64", help="--mxfp4: token counts for the per-layer MoE time")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip transformers (no ratios reported)")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly instead of through CUDA graphs")
    p.add_argument("--prefill-graphs", action="store_true",
                   help="prefills of fresh prompts replayed from CUDA graphs, in the prefill rows and the served "
                        "engine (parity: replay == the static step eagerly, and vs the eager prefill, in the same run)")
    p.add_argument("--profile", default="", help="decode batch sizes to profile (kernels, launch gaps, host)")
    p.add_argument("--profile-prefill", default="", metavar="T1,T2",
                   help="prefill lengths to profile (one sequence, eager: kernels by category, span, host)")
    p.add_argument("--served", nargs="?", const="1,16,64", default="", metavar="C1,C2,..",
                   help="also the real engine and HTTP server under C concurrent streaming clients (default "
                        "1,16,64; each must be a benchmarked batch): parity with the bench path, then speeds")
    p.add_argument("--served-requests", type=int, default=3, metavar="N", help="requests per served client")
    p.add_argument("--parity-bar", type=float, default=PARITY_BAR)
    p.add_argument("--json", type=Path, default=None, help="write the results here (atomically)")
    p.add_argument("--table", type=Path, default=None, metavar="JSON",
                   help="print the README results table of an earlier run's --json file and exit (no GPU)")
    p.add_argument("--speculative", choices=("controlled", "ngram"), default=None,
                   help="bench speculative decoding instead (controlled: the speculative path's own greedy "
                        "continuation, found untimed, with a known fraction of drafts corrupted; ngram: prompt lookup)")
    p.add_argument("--num-draft", type=int, default=4, metavar="K", help="draft tokens per score pass (--speculative)")
    p.add_argument("--spec-accept", default="0,0.5,0.8",
                   help="controlled drafter: nominal acceptance levels p, per draft (measured accepted / proposed "
                        "is expected to be sum_{i<=k} p^i / k)")
    p.add_argument("--kda-fused-score", "--kda-fused-verify", action="store_true",
                   help="speed rows use the one-launch KDA score pass")
    p.add_argument("--spec-layer-rows", default="1,2,4,8", help="rows for the per-KDA-layer score pass cost")
    p.add_argument("--context", default=None, metavar="N1,N2",
                   help="long context instead: per N one prompt prefilled as the engine chunks it (--segment), "
                        "tok/s, CUDA peak vs `plan --context N`, a decode step, parity vs the streamed fp32 gold "
                        "and the memory audit per layer kind (docs/long-context.md)")
    p.add_argument("--segment", type=int, default=8192, metavar="S",
                   help="--context: prefill chunk tokens (the engine's --max-step-tokens)")
    p.add_argument("--decode-steps", type=int, default=16, metavar="K", help="--context: decode steps timed")
    p.add_argument("--parity-base", type=int, default=1024, metavar="N",
                   help="--context: the short context whose bf16-vs-fp32 distance sets the parity bar")
    p.add_argument("--device", default=None, help="--context: cuda (default) or cpu (a tiny preset: the logic)")
    p.set_defaults(func=run)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise UsageError(f"{flag} takes comma-separated integers; got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{flag} needs positive integers; got {text!r}")
    return values


def bench_shape(args: argparse.Namespace) -> ModelShape:
    """The model to bench, through the shared resolver (real-shape presets included); UsageError names the flag."""
    preset = args.preset
    if preset is None and args.checkpoint is None:
        preset = "k3-slice-4l" if args.mxfp4 else "kl-48b-8l"
    try:
        return resolve_shape(preset, args.checkpoint)
    except TargetError as exc:
        flag = f"--checkpoint {args.checkpoint}" if args.checkpoint is not None else f"--preset {preset}"
        raise UsageError(f"{flag}: {exc}") from exc


def _weights_note(shape: ModelShape, seed: int) -> list[str]:
    if shape.checkpoint_dir is None:
        return []
    return [f"shape from {shape.checkpoint_dir}/config.json; weights generated name-seeded (seed {seed}) on the "
            "device, not read from the checkpoint"]


def run(args: argparse.Namespace) -> int:
    import torch

    if args.table is not None:
        from k3verify.bench.table import markdown_table

        try:
            data = json.loads(args.table.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"--table {args.table}: cannot read a bench JSON: {exc}") from exc
        if data.get("kind") == "mxfp4":
            from k3verify.bench.mxfp4_run import mxfp4_table

            print(mxfp4_table(data))
        elif data.get("spec"):
            from k3verify.bench.spec import markdown_table as spec_table

            print(spec_table(data))
        else:
            print(markdown_table(data))
        return 0 if data.get("speeds_reported") else 1
    if args.mxfp4 and args.parity_bar != PARITY_BAR:
        raise UsageError(f"--parity-bar {args.parity_bar} does not apply to --mxfp4: its bars derive from the measured "
                         "noise between two bf16 evaluations of the dequantized model (bench/mxfp4_parity.py)")
    if args.prefill_graphs and (args.no_graphs or args.mxfp4 or args.speculative is not None):
        raise UsageError("--prefill-graphs runs with the plain bench's CUDA graphs only (not with --no-graphs, --mxfp4 "
                         "or --speculative)")
    shape = bench_shape(args)  # before the CUDA check: a wrong name is reported on any machine
    if args.context is not None:
        return _run_long_context(args, shape)
    if args.device is not None:
        raise UsageError("--device applies to --context only: bench measures speeds on the GPU")
    if not torch.cuda.is_available():
        raise UsageError("bench needs a CUDA device; none is visible (speeds are measured on the GPU only)")
    prefill_lens = _ints(args.prefill or ("8192" if args.mxfp4 else "1024,8192"), "--prefill")
    batches = _ints(args.batch or ("1,64" if args.mxfp4 else "1,16,64"), "--batch")
    if args.mxfp4:
        return _run_mxfp4(args, shape, prefill_lens, batches)
    profile = _ints(args.profile, "--profile") if args.profile else []
    if set(profile) - set(batches):
        raise UsageError(f"--profile {profile}: only batch sizes that are also benchmarked ({batches}) can be profiled")
    if args.speculative is not None:
        return _run_spec(args, shape, batches)
    served = _ints(args.served, "--served") if args.served else []
    if set(served) - set(batches):
        raise UsageError(f"--served {served}: each concurrency must be a benchmarked batch ({batches}): the served "
                         "parity compares with the bench path at the same batch")
    if args.served_requests < 1:
        raise UsageError(f"--served-requests must be >= 1; got {args.served_requests}")
    from k3verify.bench import run as b

    plan = b.BenchPlan(shape.name, tuple(prefill_lens), tuple(batches), args.new_tokens, args.prompt_len, args.seed,
                       baseline=not args.no_baseline, use_graphs=not args.no_graphs, parity_bar=args.parity_bar,
                       profile_batches=tuple(profile), served_concurrency=tuple(served),
                       profile_prefill_lens=tuple(_ints(args.profile_prefill, "--profile-prefill")
                                                  if args.profile_prefill else ()),
                       served_requests_per_client=args.served_requests, prefill_graphs=args.prefill_graphs)
    result = b.run_bench(plan, shape.cfg, shape.hf_dict, torch.device("cuda"), b.measure_bandwidth())
    result.notes.extend(_weights_note(shape, args.seed))
    _emit(result, args.json)
    return 0 if result.speeds_reported else 1


def _run_mxfp4(args: argparse.Namespace, shape: ModelShape, prefill_lens: list[int], batches: list[int]) -> int:
    import torch

    from k3verify.bench import mxfp4
    from k3verify.bench.mxfp4_run import mxfp4_table, run_mxfp4_bench
    from k3verify.bench.run import measure_bandwidth

    plan = mxfp4.Mxfp4Plan(shape.name, tuple(prefill_lens), tuple(batches), tuple(_ints(args.moe_tokens,
                           "--moe-tokens")), args.new_tokens, args.prompt_len, args.seed)
    try:
        result = run_mxfp4_bench(plan, shape.cfg, torch.device("cuda"), measure_bandwidth())
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    result.notes.extend(_weights_note(shape, args.seed))
    data = result.to_dict()
    print(json.dumps(data, indent=1))
    print(mxfp4_table(data), file=sys.stderr)
    if args.json is not None:
        _write_json(data, args.json)
    return 0 if result.speeds_reported else 1


def _run_long_context(args: argparse.Namespace, shape: ModelShape) -> int:
    import torch

    from k3verify.bench.long_context import LongContextPlan, require_long_context_fits, run_long_context, table
    from k3verify.plan.device_fit import DoesNotFit, device_memory_gib

    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("bench --context runs on a CUDA device by default and none is visible; --device cpu runs "
                         "the logic on a tiny preset")
    try:
        plan = LongContextPlan(shape.name, tuple(_ints(args.context, "--context")), args.segment, args.decode_steps,
                               args.parity_base, args.seed)
    except ValueError as exc:
        raise UsageError(f"--context: {exc}") from None
    card = device_memory_gib(device) if device.type == "cuda" else None
    bandwidth = None
    try:
        if card is not None:  # before the bandwidth probe allocates anything
            from k3verify.bench.floor import measure_copy_bandwidth
            from k3verify.kernels.compile_watch import watch_compiles

            watch_compiles()

            require_long_context_fits(shape.cfg, plan, device, card)
            bandwidth = measure_copy_bandwidth(device)
        result = run_long_context(plan, shape.cfg, device, card, bandwidth,
                                  lambda s: print(s, file=sys.stderr, flush=True))
    except DoesNotFit as exc:
        raise UsageError(str(exc)) from None
    result.notes.extend(_weights_note(shape, args.seed))
    data = result.to_dict()
    print(table(data))
    if args.json is not None:
        _write_json(data, args.json)
    return 0 if result.passed else 1


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise UsageError(f"{flag} takes comma-separated numbers; got {text!r}") from exc
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise UsageError(f"{flag} needs numbers in [0, 1]; got {text!r}")
    return values


def _run_spec(args: argparse.Namespace, shape: ModelShape, batches: list[int]) -> int:
    import torch

    from k3verify.bench.spec import SpecPlan, markdown_table, run_spec_bench

    if args.num_draft < 1:
        raise UsageError(f"--num-draft must be >= 1; got {args.num_draft}")
    plan = SpecPlan(shape.name, tuple(batches), args.num_draft, args.speculative,
                    tuple(_floats(args.spec_accept, "--spec-accept")), args.new_tokens, args.prompt_len, args.seed,
                    fused=args.kda_fused_score, baseline=not args.no_baseline, parity_bar=args.parity_bar,
                    layer_rows=tuple(_ints(args.spec_layer_rows, "--spec-layer-rows")), use_graphs=not args.no_graphs)
    result = run_spec_bench(plan, shape.cfg, shape.hf_dict, torch.device("cuda"))
    result.notes.extend(_weights_note(shape, args.seed))
    data = result.to_dict()
    print(json.dumps(data, indent=1))
    for r in result.parity:
        print(f"  parity {r['id']}: {r['status']} metric={r['metric']:.3g} control={r['control_metric']:.3g}",
              file=sys.stderr)
    print(markdown_table(data), file=sys.stderr)
    if args.json is not None:
        _write_json(data, args.json)
    return 0 if result.speeds_reported else 1


def _emit(result: BenchResult, path: Path | None) -> None:
    data = result.to_dict()
    print(json.dumps(data, indent=1))
    lines = [f"bench {result.preset} on {result.device_name} (copy {result.copy_bandwidth_GBps:.0f} GB/s)"]
    for r in result.parity:
        lines.append(f"  parity {r['id']}: {r['status']} metric={r['metric']:.3g} control={r['control_metric']:.3g}")
    for r in result.prefill:
        lines.append(f"  prefill {r['tokens']:>6}: ours {r['ours_tok_s']:>10.0f} tok/s  baseline "
                     f"{r.get('baseline_tok_s', float('nan')):>10.0f}  ratio {r.get('ratio', float('nan')):.2f}x"
                     + (f"  (median of {r['rounds']} alternating runs; spread ours {r['ours_spread']:.0%}, baseline "
                        f"{r.get('baseline_spread', float('nan')):.0%})" if "rounds" in r else ""))
    for r in result.decode:
        lines.append(f"  decode b{r['batch']:>3}: ours {r['ours_tok_s']:>9.1f} tok/s  baseline "
                     f"{r.get('baseline_tok_s', float('nan')):>8.1f}  ratio {r.get('ratio', float('nan')):.2f}x  "
                     f"step {r['ours_step_ms']:.3f} ms  floor {r['floor_step_ms']:.3f} ms  "
                     f"{100 * r['fraction_of_floor']:.1f}% of floor")
    for r in result.served:
        ratio = r.get("served_over_bench", float("nan"))
        lines.append(f"  served c{r['concurrency']:>3}: {r['tok_s']:>9.1f} tok/s ({ratio:.2f}x the bench path)"
                     f"  TTFT p50 {r['ttft_p50_ms']:.1f} ms p99 {r['ttft_p99_ms']:.1f} ms  ITL p50 "
                     f"{r['itl_p50_ms']:.2f} ms p99 {r['itl_p99_ms']:.2f} ms{_warmup_text(r)}")
        if r.get("steps", {}).get("prefill_steps"):
            st = r["steps"]
            lines.append(f"      engine steps {st['steps']}: {st['prefill_steps']} with prefill "
                         f"({st['prefill_tokens_per_prefill_step']:.0f} prompt tokens each, launch interval p50 "
                         f"{st.get('with_prefill_interval_ms_p50', float('nan')):.1f} ms, "
                         f"{st.get('prefill_share_of_time', float('nan')):.0%} of the time); decode-only interval "
                         f"p50 {st.get('decode_only_interval_ms_p50', float('nan')):.2f} ms")
    for f in result.kernel_fallbacks:
        lines.append(f"  kernel fallback {f}")
    for p in result.profile:
        lines.append(f"  profile b{p['batch']:>3}: host step {p['host_step_ms']:.3f} ms = GPU span "
                     f"{p['gpu_span_ms']:.3f} (busy {p['gpu_busy_ms']:.3f}, idle gaps {p['idle_inside_step_ms']:.3f}) "
                     f"+ host {p['host_outside_gpu_ms']:.3f}; {p['kernels_per_step']:.0f} kernels/step")
        lines += _category_lines(p)
    for p in data.get("profile_prefill", []):
        lines.append(f"  profile prefill {p['tokens']}: host {p['host_step_ms']:.3f} ms, GPU span "
                     f"{p['gpu_span_ms']:.3f} (busy {p['gpu_busy_ms']:.3f}); {p['kernels_per_step']:.0f} kernels")
        lines += _category_lines(p)
    print("\n".join(lines), file=sys.stderr)
    from k3verify.bench.table import markdown_table

    print(markdown_table(data), file=sys.stderr)
    if path is not None:
        _write_json(data, path)


def _write_json(data: dict[str, Any], path: Path) -> None:
    """Atomically: a run cut short never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _warmup_text(row: dict[str, Any]) -> str:
    w = row.get("warmup")
    return "" if not w else (f"  (untimed warm-up wave: {w['requests']} requests, {w['wall_s']:.2f} s, "
                             f"TTFT p99 {w['ttft_p99_ms']:.1f} ms)")


def _category_lines(p: dict[str, Any]) -> list[str]:
    return [f"      {c['category']:<26} {c['ms_per_step']:7.3f} ms  {c['kernels_per_step']:6.1f} kernels"
            for c in p["by_category"][:8]]
