"""Declared endpoint precisions: the arithmetic an endpoint says it computes in, as the oracle can reproduce it.

A precision is a dtype for the oracle's "base" run, the dtype one step up for its "gold" run, and, for quantised
arithmetic, an emulation both runs compute under (`Precision.emulated()`; gates/shared/endpoint_oracle.py). The
endpoint checks take their bars from the distance between base and gold, never from the endpoint's output.

- bfloat16, float16, float32: plain dtypes (gold fp32, fp32, fp64); no emulation.
- w4a8-q8act: llama.cpp's CPU arithmetic for MXFP4 experts: the expert weights exactly as stored (MXFP4,
  dequantized exactly as the oracle always does) times activations rounded to Q8_0 blocks before every routed-expert
  matmul (gate/up inputs and the down input): blocks of 32 values, one fp16 scale max|x|/127, int8 values
  (functional.q8_0_round, bit for bit ggml's AVX2 quantizer). Everything else fp32; gold fp64 under the same
  emulation (each Q8_0 block rounded from its fp64 values cast to fp32).
- w-gguf-a8: llama.cpp's CPU arithmetic for a GGUF's weights (`parity --weights-from GGUF`): every weight as
  the file stores it (dequantized by gguf-py), every matmul input rounded to the format its weight's type pairs
  with (Q8_0 for Q8_0/Q4_0/Q5_0, Q8_K for the k-quants and IQ types, F16 for F16; oracle/gguf_arith.py has the
  table), bit for bit ggml's quantizers, then multiplied exactly; MLA absorbed as llama.cpp computes it. Base
  fp32, gold fp64 under the same emulation (each block rounded from its values cast to fp32). No rounding is
  excused: the bar is the oracle's own distance to itself in this arithmetic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from k3verify.oracle import active


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: torch.dtype
    gold_dtype: torch.dtype
    description: str
    emulation: tuple[tuple[str, str], ...] = ()  # oracle knobs (oracle/active.py) the base run computes under

    @contextlib.contextmanager
    def emulated(self) -> Iterator[None]:
        """Every oracle forward inside computes in this precision's arithmetic (a no-op for plain dtypes); on exit,
        exceptions included, exactly as before. Not thread-safe (oracle/active.py)."""
        with active.overriding(dict(self.emulation)):
            yield


PRECISIONS: dict[str, Precision] = {
    "bfloat16": Precision("bfloat16", torch.bfloat16, torch.float32, "bf16 weights and activations"),
    "float16": Precision("float16", torch.float16, torch.float32, "fp16 weights and activations"),
    "float32": Precision("float32", torch.float32, torch.float64, "fp32 weights and activations"),
    "w4a8-q8act": Precision(
        "w4a8-q8act", torch.float32, torch.float64,
        "fp32, with MXFP4 routed experts multiplied by activations rounded to Q8_0 blocks (llama.cpp's CPU path)",
        emulation=(("moe.expert_activations", "q8_0"),)),
    "w-gguf-a8": Precision(
        "w-gguf-a8", torch.float32, torch.float64,
        "fp32, with every GGUF weight times its input rounded to the block format the weight's ggml type pairs "
        "with (llama.cpp's CPU path; needs --weights-from GGUF)",
        emulation=(("linear.gguf_activations", "on"),)),
}


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise KeyError(f"unknown precision {name!r}; known: {', '.join(PRECISIONS)}") from None
