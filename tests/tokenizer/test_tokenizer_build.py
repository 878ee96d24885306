"""tools/build_tokenizer.py: re-running it reproduces the committed assets byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from k3verify.tokenizer.tokenizer import ASSETS_DIR, CONFIG_FILE, MODEL_FILE

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "tools" / "build_tokenizer.py"


def run_build(*args: str, hash_seed: str = "0") -> subprocess.CompletedProcess[str]:
    # the script imports the package: this checkout's, whichever copy is installed
    env = {**os.environ, "PYTHONHASHSEED": hash_seed,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_rebuild_is_byte_identical_to_committed_assets(tmp_path: Path) -> None:
    """Two builds under different hash seeds both write exactly the committed tiktoken.model and config."""
    for seed in ("0", "12345"):
        out = tmp_path / seed
        result = run_build("--out", str(out), hash_seed=seed)
        assert result.returncode == 0, result.stderr
        for name in (MODEL_FILE, CONFIG_FILE):
            assert (out / name).read_bytes() == (ASSETS_DIR / name).read_bytes(), f"{name} differs (seed {seed})"


def test_check_mode_detects_stale_assets(tmp_path: Path) -> None:
    """`--check` passes on the committed assets and fails once one token rank line is changed."""
    for name in (MODEL_FILE, CONFIG_FILE):
        (tmp_path / name).write_bytes((ASSETS_DIR / name).read_bytes())
    assert run_build("--check", "--out", str(tmp_path)).returncode == 0
    lines = (tmp_path / MODEL_FILE).read_text().splitlines(keepends=True)
    lines[-1], lines[-2] = (
        lines[-2].replace(f" {len(lines) - 2}", f" {len(lines) - 1}"),
        lines[-1].replace(f" {len(lines) - 1}", f" {len(lines) - 2}"),
    )
    (tmp_path / MODEL_FILE).write_text("".join(lines))
    result = run_build("--check", "--out", str(tmp_path))
    assert result.returncode == 1
    assert MODEL_FILE in result.stderr
