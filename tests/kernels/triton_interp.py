"""Fixes to Triton's CPU interpreter (triton 3.9, runtime/interpreter.py) for the kernel tests' child
processes, so that interpreted bf16 kernels compute what the GPU computes:

- fp32 -> bf16 conversion: the interpreter (`_convert_float`) truncates where the GPU rounds to nearest
  even (cvt.rn.bf16.f32); routed through torch's round-to-nearest-even;
- tl.dot on bf16 operands: the interpreter keeps bf16 as uint16 and multiplies those integers
  (`create_dot` converts only 8-bit floats); bf16 operands are widened to fp32 first (exact), as the
  tensor cores' products are exact with fp32 accumulation.

Call `patch_interpreter()` after TRITON_INTERPRET=1 is set and before any kernel runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def round_bf16_to_nearest_even() -> None:
    """Replace the interpreter's fp32 -> bf16 conversion by torch's (RTNE); other casts are unchanged."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    stock: Callable[..., Any] = interp._convert_float

    def convert(data: np.ndarray, src: Any, dst: Any, rounding_mode: Any) -> np.ndarray:
        if src == tl.float32 and dst == tl.bfloat16:
            f32 = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return stock(data, src, dst, rounding_mode)

    interp._convert_float = convert


def bf16_dot_in_fp32() -> None:
    """tl.dot on bf16 operands multiplies their values (widened exactly to fp32), not their bit patterns."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    stock: Callable[..., Any] = interp.InterpreterBuilder.create_dot

    def widen(h: Any) -> Any:
        if h.dtype != tl.bfloat16:
            return h
        return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        return stock(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = create_dot


def patch_interpreter() -> None:
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("TRITON_INTERPRET=1 must be set in the environment before triton is imported")
    round_bf16_to_nearest_even()
    bf16_dot_in_fp32()


def child_report(module: str, function: str, tmp: str, timeout_s: int = 600) -> dict[str, Any]:
    """Run `function(tmp)` of tests/kernels/`module` in a child process with TRITON_INTERPRET=1 (the variable must
    be set before triton is first imported, hence the child) and return the dict it reports, through JSON."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import k3verify

    root = str(Path(k3verify.__file__).resolve().parents[1])
    code = (f"import json, sys; sys.path.insert(0, sys.argv[1]); import {module} as m; "
            f"print('REPORT ' + json.dumps(m.{function}(sys.argv[2])))")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), tmp], env=env, cwd=root,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("REPORT "))
    report: dict[str, Any] = json.loads(line.removeprefix("REPORT "))
    return report


def broken_variant(module: Any, name: str, old: str, new: str, tmp: str) -> Any:
    """`module` (a kernel module) imported again from its own source with `old` replaced by `new` (exactly one
    occurrence, else the variant would test nothing): a control the kernel comparison must catch."""
    import importlib.util
    from pathlib import Path

    source = Path(module.__file__).read_text()
    if source.count(old) != 1:
        raise RuntimeError(f"broken variant {name}: snippet {old!r} is not in {module.__name__} exactly once")
    stem = f"{module.__name__.rsplit('.', 1)[-1]}_{name}"
    path = Path(tmp) / f"{stem}.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location(stem, path)
    assert spec is not None and spec.loader is not None
    variant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variant)
    return variant
