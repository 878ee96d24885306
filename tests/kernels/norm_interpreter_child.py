"""Child process for tests/kernels/test_kernels_norm.py: runs the Triton norm kernels under Triton's
CPU interpreter on saved cases and saves their outputs.

    TRITON_INTERPRET=1 python tests/kernels/norm_interpreter_child.py CASES.pt OUTPUTS.pt

TRITON_INTERPRET must be set before triton is first imported, hence a process of its own. The
interpreter (triton 3.9, runtime/interpreter.py `cast_impl`) truncates fp32 -> bf16 where the GPU
rounds to nearest even (cvt.rn.bf16.f32); the kernels' bf16 roundings are what is under test, so the
cast is routed through torch's round-to-nearest-even (tests/kernels/triton_interp.py) before any kernel runs.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from triton_interp import round_bf16_to_nearest_even


def main(cases_path: str, outputs_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("TRITON_INTERPRET=1 must be set in the environment before triton is imported")
    round_bf16_to_nearest_even()
    from k3verify.kernels.norm import norm_launch

    cases: dict[str, dict[str, Any]] = torch.load(cases_path)
    outputs: dict[str, torch.Tensor] = {}
    for name, c in cases.items():
        if c["op"] == "rms":
            outputs[name] = norm_launch.rms_norm_triton(c["x"], c["weight"], c["eps"])
        else:
            outputs[name] = norm_launch.gated_rms_norm_triton(c["x"], c["gate"], c["weight"], c["eps"])
    torch.save(outputs, outputs_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
