"""Measure where each catalogued convention is identifiable (k3verify/oracle/identify.py says how), and how far
apart the alternatives are from each other: the numbers docs/conventions.md records.

    python tools/measure_conventions.py                          # every synthetic preset
    python tools/measure_conventions.py --preset k3-tp4 --pairs  # one preset, with the pairwise distances
"""

from __future__ import annotations

import argparse

import torch

from k3verify.oracle.conventions import alternatives_for
from k3verify.oracle.identify import IDENTIFIABLE_FACTOR, logprob_distance, logprobs, measure, prompts
from k3verify.oracle.precision import PRECISIONS
from k3verify.presets import SYNTHETIC_PRESETS, get_preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", choices=SYNTHETIC_PRESETS, help="repeatable; default: all")
    parser.add_argument("--pairs", action="store_true", help="also print the distance between every two alternatives")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for preset in args.preset or SYNTHETIC_PRESETS:
        m = measure(preset, alternatives_for(get_preset(preset)))
        ids = prompts(get_preset(preset))
        gold = logprobs(preset, torch.float64, ids)
        w4a8 = PRECISIONS["w4a8-q8act"]
        with w4a8.emulated():
            emulated = logprobs(preset, w4a8.dtype, ids)
        print(f"\n{preset}: fp32-vs-fp64 noise {m.noise_fp32:.3g}, bf16-vs-fp32 noise {m.noise_bf16:.3g}, "
              f"w4a8-q8act-vs-fp64 {logprob_distance(gold, emulated):.3g}; identifiable at >= "
              f"{IDENTIFIABLE_FACTOR:g}x the noise of its dtype")
        for text, effect in m.effects.items():
            noise = m.noise_bf16 if text.split("=")[0].endswith("_precision") else m.noise_fp32
            flag = "identifiable" if effect >= IDENTIFIABLE_FACTOR * noise else "-"
            print(f"  {text:55s} {effect:10.3g}  {effect / noise:10.3g}x  {flag}")
        if args.pairs:
            names = [t for t in m.rows if not t.split("=")[0].endswith("_precision")]
            print("  pairwise (rows: reference):")
            for a in names:
                near = sorted((logprob_distance(m.rows[a], m.rows[b]), b) for b in names if b != a)[:3]
                print(f"    {a:50s} nearest: " + "; ".join(f"{b} {d:.3g}" for d, b in near))


if __name__ == "__main__":
    main()
