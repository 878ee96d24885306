"""Measure and record the noise every noise-barred check derives its bar from (k3verify/gates/core/noise.json).

For each preset, every check registered with `noise=` runs once at seed 0 with the recording ignored, so it
measures its own reference pair (the oracle at the check's precision vs fp64, on the check's inputs). The
values, the rule and the bars they give are written to the JSON, keyed by the synthetic checkpoint's digest;
presets not measured in this call keep their entries. The printed table also shows this run's candidate
metric against the derived bar (the recording itself holds reference-only numbers).

    python tools/measure_noise.py                       # the four synthetic presets, CPU
    python tools/measure_noise.py --preset k3-tiny --out /tmp/noise.json
    python tools/measure_noise.py --preset kl-tiny --only 'serving.long_context.*'   # one check, others kept
    python tools/measure_noise.py --device cuda --out $OUT/noise-cuda.json   # on the GPU (not committed)
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path
from typing import Any

import torch

from k3verify.gates.core import noise
from k3verify.gates.core.suite import load_all_checks, make_context_factory, run_check
from k3verify.target import resolve_target

PRESETS = ("k3-tiny", "k3-syn-25", "k3-skew-10", "kl-tiny")


def measure_preset(preset: str, device: str, only: list[str] | None = None, kept: dict[str, Any] | None = None
                   ) -> tuple[dict[str, Any], list[tuple[str, ...]], list[str]]:
    """(the preset's recording entry, table rows, the noise-barred checks that were not green). With `only` (check
    id globs) just those are measured; the others keep what `kept` (the preset's old entry) recorded, when its
    digest is this preset's."""
    target = resolve_target(preset, None)
    factory = make_context_factory(target, device=device, seed=noise.RECORDED_SEED, suite="full", measure_noise=True)
    checks: dict[str, Any] = {}
    if only and kept is not None and kept.get("digest") != target.digest:
        return dict(kept), [], [f"{preset}: recorded for digest {kept.get('digest')}, this checkpoint is "
                                f"{target.digest}: measure the whole preset (no --only)"]
    if only and kept is not None:
        checks = {cid: v for cid, v in kept.get("checks", {}).items()
                  if not any(fnmatch.fnmatchcase(cid, pattern) for pattern in only)}
    rows: list[tuple[str, ...]] = []
    bad: list[str] = []
    for check in (c for c in load_all_checks() if c.noise is not None):
        if only and not any(fnmatch.fnmatchcase(check.id, pattern) for pattern in only):
            continue
        result = run_check(check, factory, noise.RECORDED_SEED, torch.device(device).type)
        if result.status.value == "skipped":
            continue
        if result.noise is None or result.status.value != "pass":
            bad.append(f"{check.id}: {result.status.value}: {result.reason}")
            continue
        n = result.noise
        checks[check.id] = {"noise": n["value"], "dtype": n["dtype"], "pair": n["pair"], "bar": result.bar,
                            "derivation": n["derivation"]}
        rows.append((preset, check.id, f"{n['value']:.3g}", f"{result.bar:.3g}", f"{result.metric:.3g}",
                     f"{result.margin:.3f}"))
    entry: dict[str, Any] = {"digest": target.digest, "device": torch.device(device).type, "seed": noise.RECORDED_SEED,
             "torch": torch.__version__, "checks": dict(sorted(checks.items()))}
    return entry, rows, [f"{preset} {line}" for line in bad]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=PRESETS, help="repeatable; default: all four")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=noise.RECORDING)
    parser.add_argument("--only", action="append", metavar="GLOB",
                        help="repeatable: measure only these check ids; the preset's other recorded checks are kept")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the tiny models run fastest single-threaded; the bits do not depend on it
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    presets = dict(old.get("presets", {}))
    table, bad = [], []
    for preset in args.preset or PRESETS:
        presets[preset], rows, not_green = measure_preset(preset, args.device, args.only, presets.get(preset))
        table += rows
        bad += not_green
    data = {
        "generated_by": "python tools/measure_noise.py",
        "rule": (f"bar = max({noise.FACTOR:g} x noise, {noise.FLOOR_ROUNDINGS} unit roundoffs of the check's dtype); "
                 "noise = relative RMS of the same reference at the check's precision vs fp64, on the check's "
                 "inputs (gates/core/noise.py)"),
        "factor": noise.FACTOR,
        "floor_roundings": noise.FLOOR_ROUNDINGS,
        "presets": dict(sorted(presets.items())),
    }
    header = ("preset", "check", "noise", "bar", "metric", "margin")
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    for row in [header, *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    if bad:
        print("not green, nothing written:\n  " + "\n  ".join(bad))
        return 1
    args.out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
