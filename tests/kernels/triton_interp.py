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
