"""lab/gpu/gpu_session.sh runs from the repository root: every script, module, test file and case it names exists
(parsed from the shell text, no GPU needed)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "lab" / "gpu" / "gpu_session.sh"


def case_bodies(text: str) -> dict[str, str]:
    """case label -> its body, from the top-level `case "${1:-}" in ... esac`."""
    body = text[text.index('case "${1:-}" in'):text.rindex("esac")]
    parts = re.split(r"^([a-z0-9*-]+)\)", body, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def missing_references(text: str, root: Path) -> list[str]:
    """What the script names that is not there: lab/tools modules and files, test paths, cases it runs."""
    cases = set(case_bodies(text))
    missing = [f"module {m}" for m in re.findall(r"python3 -m ((?:lab|tools)(?:\.\w+)+)", text)
               if not (root / (m.replace(".", "/") + ".py")).is_file()]
    missing += [f"file {p}" for p in re.findall(r"\b((?:lab|tools|tests)/[\w/.-]+\.(?:py|sh))\b", text)
                if not (root / p).is_file()]
    missing += [f"folder {p}" for p in re.findall(r"\s(tests/\w+)(?=\s)", text) if not (root / p).is_dir()]
    runs = re.findall(r'bash "\$0" ([a-z0-9-]+)', text) + re.findall(r"gpu_session\.sh ([a-z0-9-]+)", text)
    usage = re.search(r"usage: bash \S+ ([a-z0-9|-]+)", text)
    runs += usage.group(1).split("|") if usage else ["(no usage line)"]
    missing += [f"case {c}" for c in runs if c not in cases]
    return missing


def test_every_case_names_only_what_exists() -> None:
    """Each `python3 -m lab.gpu.X`, tools/ or tests/ path, `bash "$0" CASE` and documented case resolves."""
    text = SESSION.read_text()
    assert len(case_bodies(text)) >= 25, sorted(case_bodies(text))
    assert not missing_references(text, ROOT)


def test_lab_modules_it_runs_are_the_lab_folder() -> None:
    """Every Python script the session runs is a module of lab.gpu or a file of tools/ (no scripts/ left)."""
    text = SESSION.read_text()
    assert "scripts/" not in text
    assert len(re.findall(r"python3 -m lab\.gpu\.\w+", text)) >= 15


def test_session_parses_as_bash() -> None:
    """bash -n accepts the script."""
    assert subprocess.run(["bash", "-n", str(SESSION)]).returncode == 0


@pytest.mark.parametrize("broken", [
    "    python3 -m lab.gpu.no_such_probe --x\n",
    "    timeout 9 python3 -m pytest -q tests/kernels/test_no_such_file.py\n",
    '    THEN= bash "$0" no-such-case\n',
    "    python3 tools/no_such_tool.py\n",
])
def test_detector_flags_a_dangling_reference(broken: str) -> None:
    """A case that names a missing module, test file, case or tool is reported."""
    text = SESSION.read_text().replace("parity)\n", "parity)\n" + broken, 1)
    assert missing_references(text, ROOT)
