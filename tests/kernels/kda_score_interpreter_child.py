"""Child process for tests/kernels/test_kernels_kda_score.py: runs the Triton KDA score kernels under Triton's
CPU interpreter on saved cases and saves what they wrote.

    TRITON_INTERPRET=1 python tests/kernels/kda_score_interpreter_child.py CASES.pt OUTPUTS.pt

Per case: the unfused chain (spec_conv_triton -> record_triton -> norm_triton) and the fused launch, each into its
own NaN-filled records, over the same read-only pool, each with the shipped value block and a narrower one. The
kernels round to bf16 with explicit integer rounding and cast only exact values, so the interpreter's truncating
fp32 -> bf16 cast never decides a bit.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

# path -> (fused, value columns per program, positions unrolled): the narrow block runs more programs per head (more
# tickets); the unrolled build is the same code with its positions unrolled at compile time
PATHS = {"unfused": (False, 32, False), "fused": (True, 32, False), "unfused_bv16": (False, 16, False),
         "fused_bv16": (True, 16, False), "unfused_unrolled": (False, 32, True), "fused_unrolled": (True, 32, True)}


def _run(c: dict[str, Any], fused: bool, value_block: int, unroll: bool) -> dict[str, torch.Tensor]:
    from k3verify.kernels.kda import score_launch as vt

    launch = vt.Launch(value_block, num_warps=2 if value_block < 32 else 4, unroll=unroll)
    B, N, H, DK = c["g"].shape
    conv_rec = torch.full((B, N, 3, H * DK, c["weights"][0].shape[-1] - 1), float("nan"))
    state_rec = torch.full((B, N, H, DK, DK), float("nan"))
    pool = (tuple(w.clone() for w in c["windows"]), c["state"].clone())
    if fused:
        o, y = vt.fused_triton(c["xs"], c["weights"], pool[0], pool[1], c["slots"], c["keep"], c["g"], c["beta"],
                               c["gate"], c["norm_weight"], c["eps"], c["scale"], conv_rec, state_rec, launch=launch)
    else:
        q, k, v = vt.spec_conv_triton(c["xs"], c["weights"], pool[0], c["slots"], c["keep"], conv_rec)
        o = vt.record_triton(q.view(B, N, H, DK), k.view(B, N, H, DK), v.view(B, N, H, DK), c["g"], c["beta"],
                             pool[1], c["slots"], c["scale"], state_rec, launch=launch)
        y = vt.norm_triton(o, c["gate"], c["norm_weight"], c["eps"])
    tickets = vt.head_counters(torch.device("cpu"))
    return {"o": o, "y": y, "conv_records": conv_rec, "state_records": state_rec, "pool_state": pool[1],
            "pool_windows": torch.stack(pool[0]), "tickets_left": tickets[tickets != 0].clone()}


def main(cases_path: str, outputs_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("TRITON_INTERPRET=1 must be set in the environment before triton is imported")
    cases: dict[str, dict[str, Any]] = torch.load(cases_path)
    out = {f"{name}.{path}": _run(c, *how) for name, c in cases.items() for path, how in PATHS.items()}
    torch.save(out, outputs_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
