"""The maintained tools in tools/ run as their docstrings say (`python tools/X.py`, from any directory; chaos, which
imports its siblings, as `python -m tools.chaos` from the repository root), each on a small real workload.
Tools exercised elsewhere in the suite: build_tokenizer (tests/tokenizer), load_test, chaos and chaos_kill
(tests/api), screenshot_report (tests/gates/test_html_render.py), size_report (test_size_report.py here),
build_llamacpp.sh (.ci/run builds with it; tests/peers run what it built)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"


def run_tool(name: str, *args: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, str(TOOLS / name), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=180)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}: {proc.stderr[-3000:]}"
    return proc.stdout


def test_measure_noise_records_every_recorded_check_of_k3_tiny(tmp_path: Path) -> None:
    """measure_noise on k3-tiny writes an entry for the same checkpoint and the same checks as the committed
    recording, each with a positive bar."""
    out = tmp_path / "noise.json"
    run_tool("measure_noise.py", "--preset", "k3-tiny", "--out", str(out), cwd=tmp_path)
    got = json.loads(out.read_text())["presets"]["k3-tiny"]
    recorded = json.loads((ROOT / "k3verify" / "gates" / "core" / "noise.json").read_text())["presets"]["k3-tiny"]
    assert got["digest"] == recorded["digest"]
    assert set(got["checks"]) == set(recorded["checks"]) and got["checks"], sorted(got["checks"])
    assert all(c["bar"] > 0 for c in got["checks"].values())


def test_measure_conventions_prints_each_alternative_of_k3_tiny(tmp_path: Path) -> None:
    """measure_conventions on k3-tiny prints the noise line and one row per catalogued alternative."""
    out = run_tool("measure_conventions.py", "--preset", "k3-tiny", cwd=tmp_path)
    assert "k3-tiny: fp32-vs-fp64 noise" in out, out
    assert "moe.combine_precision=activation" in out and out.count("x  ") >= 3, out


def test_batch_invariance_writes_its_rows(tmp_path: Path) -> None:
    """batch_invariance at one trial: one table row and one JSON row per batch size, with its numbers."""
    out_json = tmp_path / "rows.json"
    out = run_tool("batch_invariance.py", "--trials", "1", "--steps", "2", "--batches", "2,3", "--dtypes",
                   "float32", "--json", str(out_json), cwd=tmp_path)
    rows = json.loads(out_json.read_text())
    assert [r["batch"] for r in rows] == [2, 3] and all(r["trials"] == 1 for r in rows), rows
    assert out.count("| cpu | float32 | eager |") == 2, out


def test_size_report_runs_as_a_script(tmp_path: Path) -> None:
    """size_report over the package with limits nothing exceeds: exit 0 and a table with no rows."""
    run_tool("size_report.py", "--max-file", "100000", "--max-func", "100000", cwd=tmp_path)


def test_chaos_runs_as_a_module_of_tools() -> None:
    """chaos imports load_test and chaos_kill as tools.*: `python -m tools.chaos --help` from the root loads them."""
    proc = subprocess.run([sys.executable, "-m", "tools.chaos", "--help"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0 and "--kill-clients" in proc.stdout, proc.stderr[-2000:]


def test_ci_builds_llama_cpp_with_the_tool() -> None:
    """.ci/run calls tools/build_llamacpp.sh, which exists and parses as bash."""
    assert "bash tools/build_llamacpp.sh" in (ROOT / ".ci" / "run").read_text()
    assert subprocess.run(["bash", "-n", str(TOOLS / "build_llamacpp.sh")]).returncode == 0
