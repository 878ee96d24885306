"""How long does torch's fused SDPA hold the host, per backend, for MLA prefill shapes? (diagnostic, CUDA)

The served profile (H200, 2026-12-02, lab/host_syncs.LongCalls on the engine thread) found the packed MLA
prefill attention's `scaled_dot_product_attention(..., is_causal=True)` holding the host 60-80 ms per call at
32 fresh prompts of 128 tokens, with or without the GPU kept behind: host work, not a wait for the GPU. This
times each backend at the served and bench shapes: the backend torch picks, host ms of the first call, host ms
of steady calls (same shapes, fresh tensors each call, and from a second thread), and the GPU time.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def tensors(B: int, L: int, h: int, dqk: int, dv: int) -> tuple[torch.Tensor, ...]:
    q = torch.randn(B, L, h, dqk, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, L, h, dqk, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(B, L, h, dv, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return q, k, v


def call(backend: SDPBackend | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
    """(host ms, GPU ms) of one call, the GPU idle before it."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    if backend is None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    end.record()
    host = 1e3 * (time.perf_counter() - t0)
    end.synchronize()
    return host, start.elapsed_time(end)


def in_thread(backend: SDPBackend | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> list[tuple[float, float]]:
    """Two calls from a new thread (is any cache per thread?)."""
    out: list[tuple[float, float]] = []
    t = threading.Thread(target=lambda: out.extend(call(backend, q, k, v) for _ in range(2)))
    t.start()
    t.join()
    if len(out) != 2:
        raise RuntimeError("the call in a second thread raised (see its traceback above)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="32x128,64x128,16x128,1x1024,1x8192")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    h, dqk, dv = 32, 192, 128  # kl-48b-8l's MLA: 32 heads, nope 128 + rope 64, v 128
    names = {int(b): n for n, b in BACKENDS.items() if b is not None}
    rows = []
    for shape in a.shapes.split(","):
        B, L = map(int, shape.split("x"))
        q, k, v = tensors(B, L, h, dqk, dv)
        picked = names.get(int(torch._fused_sdp_choice(q, k, v, is_causal=True)), "?")
        for name, backend in BACKENDS.items():
            try:
                first = call(backend, q, k, v)
                same = [call(backend, q, k, v) for _ in range(a.reps)]
                fresh = [call(backend, *tensors(B, L, h, dqk, dv)) for _ in range(a.reps)]
                other = in_thread(backend, q, k, v)
            except RuntimeError as exc:
                rows.append(f"{shape:>8} {name:>9} refused: {str(exc).splitlines()[0][:90]}")
                continue
            med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
            rows.append(f"{shape:>8} {name:>9} {first[0]:>9.2f} {med(same, 0):>9.2f} {med(fresh, 0):>9.2f} "
                        f"{other[0][0]:>9.2f} {other[1][0]:>9.2f} {med(same, 1):>8.3f}   (torch picks {picked})")
    print(f"{'BxL':>8} {'backend':>9} {'first ms':>9} {'same ms':>9} {'fresh ms':>9} {'thread1':>9} {'thread2':>9} "
          f"{'GPU ms':>8}   host ms per call unless GPU")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
