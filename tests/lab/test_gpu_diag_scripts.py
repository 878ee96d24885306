"""The GPU diagnostic scripts run end to end on CPU (their smoke mode) before a device call spends time on them:
lab/gpu/engine_step_diag.py, lab/gpu/spec_round_diag.py and lab/gpu/served_profile.py on kl-tiny."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", f"lab.gpu.{script}", "--device", "cpu", "--preset", "kl-tiny",
                           *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_engine_step_diag_smoke() -> None:
    out = _run("engine_step_diag", "--prompts", "2", "--prompt-len", "8", "--running", "2", "--reps", "1",
               "--top", "3")
    table = out[out.index("case "):]
    for case in ("model.prefill (no caches)", "runner.prefill", "launch+collect (prefill only)",
                 "decode graph (running rows)", "launch+collect (decode only)", "launch+collect (mixed)"):
        assert case in table, out[-2000:]


def test_spec_round_diag_smoke() -> None:
    out = _run("spec_round_diag", "--prompt-len", "8", "--rounds", "3", "--profile", "3")
    for piece in ("propose", "verify", "readback", "accept", "commit"):
        assert f"\n{piece} " in out, out
    assert "round " in out and "score on the device" in out
    assert "offline loop: decode phase" in out and "cProfile of 3 runs" in out, out
    # fp32 on CPU: speculative greedy is plain greedy, so plain greedy's continuation is already the path's own
    assert "reference converged after 1 untimed runs" in out, out


def test_served_profile_smoke() -> None:
    out = _run("served_profile", "--concurrency", "2", "--waves", "1", "--prompt-len", "8", "--new-tokens", "4",
               "--top", "5")
    assert "served at concurrency 2" in out and "steps: {" in out, out[-2000:]
    assert "engine thread, sampled" in out and "on the stack (inclusive)" in out, out[-2000:]
    assert "k3verify/serving/engine_loop.py" in out, "the samples hold the engine thread's step loop frames"


def test_served_profile_long_calls_smoke() -> None:
    out = _run("served_profile", "--concurrency", "2", "--waves", "1", "--prompt-len", "8", "--new-tokens", "4",
               "--top", "5", "--probe", "calls")
    assert "C calls that held it" in out and "call site -> callee" in out, out[-2000:]
