"""Registers, spills and programs per SM of the Triton KDA score kernels, compiled offline for sm_90 (no GPU).

Triton compiles for a target without a device (`triton.compile` with a GPUTarget), and its wheel carries ptxas and
cuobjdump, so register use can be read on the CPU machine. It depends on the Triton version: on 2026-12-02 the
fused kernel took 170 registers with Triton 3.6 (the H200 image's) and 188 with 3.9; plain `tl.sum` in place of
the fixed-tree sums cut 3.9's count and raised 3.6's. Read it with the device's version:

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    python -m lab.gpu.kernel_regs --launch 32:4:- --launch 32:4:128

A launch is VALUE_BLOCK:WARPS:MAXNREG ('-': no cap). Programs per SM count registers (allocated in units of 8 per
thread), warps (64 per SM) and shared memory; they are what decides how many waves a score of rows x heads x value
blocks runs in (lab/gpu/score_tune.py times them on the GPU).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from k3verify.kernels.kda import score_kernel as vk
from k3verify.kernels.kda import score_launch as vt

REGS_PER_SM, WARPS_PER_SM, SMEM_PER_SM = 65536, 64, 228 * 1024
FUSED_SIG = {
    "xq": "*bf16", "xk": "*bf16", "xv": "*bf16", "wq": "*bf16", "wk": "*bf16", "wv": "*bf16", "winq": "*fp32",
    "wink": "*fp32", "winv": "*fp32", "s_x": "i32", "s_slot": "i32", "s_d": "i32", "s_tap": "i32", "slots_ptr": "*i64",
    "keep_ptr": "*fp32", "state_ptr": "*fp32", "g_ptr": "*fp32", "beta_ptr": "*fp32", "gate_ptr": "*bf16",
    "nw_ptr": "*bf16", "conv_rec": "*fp32", "state_rec": "*fp32", "o_ptr": "*bf16", "y_ptr": "*bf16",
    "counter_ptr": "*i32", "scale": "fp32", "eps": "fp32", "H": "i32", "DK": "i32", "DV": "i32"}
RECORD_SIG = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*fp32", "state_ptr": "*fp32",
    "slots_ptr": "*i64", "rec_ptr": "*fp32", "o_ptr": "*bf16", "scale": "fp32", "H": "i32", "DK": "i32", "DV": "i32"}


def compile_kernel(kind: str, launch: vt.Launch, head_dim: int, positions: int, width: int) -> Any:
    """The fused or the record kernel compiled for sm_90 with `launch`'s options (the launchers' own)."""
    log2 = head_dim.bit_length() - 1
    if kind == "fused":
        fn, sig = vk.kda_score_fused_kernel, dict(FUSED_SIG)
        const: dict[str, Any] = dict(N=positions, W=width, BK=head_dim, BV=launch.value_block,
                                     NVB=head_dim // launch.value_block, BVF=head_dim, LOG2K=log2, LOG2V=log2,
                                     BF16=True, UNROLL=launch.unroll)
    else:
        fn, sig = vk.kda_record_kernel, dict(RECORD_SIG)
        const = dict(N=positions, BK=head_dim, BV=launch.value_block, LOG2K=log2, BF16=True, UNROLL=launch.unroll)
    sig.update({name: "constexpr" for name in const})
    return triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=launch.options())


def resource_usage(kernel: Any) -> tuple[int, int]:
    """(registers per thread, spill stack bytes) of a compiled kernel's cubin, by the wheel's cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(kernel.asm["cubin"])
        fh.flush()
        out = subprocess.run([tool, "--dump-resource-usage", fh.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out[-500:]}")
    return int(m.group(1)), int(m.group(2))


def programs_per_sm(regs: int, warps: int, shared: int) -> int:
    by_regs = REGS_PER_SM // (-(-regs // 8) * 8 * 32 * warps)
    return min(by_regs, WARPS_PER_SM // warps, SMEM_PER_SM // max(shared, 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launch", action="append", default=None,
                    help="VALUE_BLOCK:WARPS:MAXNREG ('-': no cap), ':u' appended: positions unrolled")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--positions", type=int, default=5)
    ap.add_argument("--width", type=int, default=4)
    a = ap.parse_args()
    launches = a.launch or ["32:4:-", "32:4:128"]
    print(f"Triton {triton.__version__}, sm_90, head dim {a.head_dim}, {a.positions} positions")
    print("kernel  BV  warps  maxnreg  unroll  regs  spill B  smem B  programs/SM  warps/SM")
    for kind in ("fused", "record"):
        for spec in launches:
            bv, warps, cap, *flag = spec.split(":")
            launch = vt.Launch(int(bv), int(warps), None if cap == "-" else int(cap), unroll=flag == ["u"])
            kernel = compile_kernel(kind, launch, a.head_dim, a.positions, a.width)
            regs, spill = resource_usage(kernel)
            shared = int(kernel.metadata.shared)
            per_sm = programs_per_sm(regs, launch.num_warps, shared)
            print(f"{kind:7s} {launch.value_block:3d} {launch.num_warps:6d} {cap:>8s} {str(launch.unroll):>7s} "
                  f"{regs:5d} {spill:8d} {shared:7d} {per_sm:12d} {per_sm * launch.num_warps:9d}")

if __name__ == "__main__":
    main()
