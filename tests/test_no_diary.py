"""The product speaks of itself only: no line of the package or of README.md says when, in which result folder or
in which round of work something was measured or changed. Such a line names a date, a result folder
(`h200-...`), an issue, an ordinal round of work ("the thirteenth ...") or "this/next session"; where and when a
number was measured belongs in docs/results/ (docs/results/README.md indexes the runs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "k3verify"
# Binary or machine-written data with no prose in it: the tokenizer's rank table (base64 tokens, one a line).
NOT_PROSE = {"tokenizer/assets/tiktoken.model"}

ORDINAL = (r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
           r"fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth)")
# name -> pattern (case-insensitive); each names one way a line can date itself
DIARY: dict[str, str] = {
    "date": r"(?<!\d)20\d\d-\d\d-\d\d(?!\d)",
    "result folder": r"\b[a-z]\d{3}-(?:x\d+-)?\d|\b(?:cpu|gpu|h100|h200)-20\d\d",
    "issue": r"\bissues?\b|\bPR\s*#?\d+",
    "session": r"\b(?:this|next|last|previous|earlier|later|that|a later|an earlier)\s+session\b|\bsessions?\s+\d+",
    "ordinal round": rf"\b{ORDINAL}\s+(?:session|round of work|round|day|engineer|helper)\b"
                     r"|\b(?:ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|"
                     r"eighteenth|nineteenth|twentieth)\b",
}
_COMPILED = {name: re.compile(p, re.IGNORECASE) for name, p in DIARY.items()}


def diary_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, line) for every line that dates itself."""
    found = []
    for i, line in enumerate(text.splitlines(), 1):
        for name, pattern in _COMPILED.items():
            if pattern.search(line):
                found.append((i, name, line.strip()[:160]))
                break
    return found


def _product_files() -> list[Path]:
    files = [p for p in sorted(PACKAGE.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
             and p.suffix != ".pyc" and str(p.relative_to(PACKAGE)) not in NOT_PROSE]
    return [*files, ROOT / "README.md"]


def test_package_and_readme_hold_no_diary_line() -> None:
    """Every text file under k3verify/ and README.md: no date, result folder, issue, session or ordinal round."""
    files = _product_files()
    assert len(files) > 200, f"expected the package's files; found {len(files)}"
    offenders = [f"{f.relative_to(ROOT)}:{n}: [{kind}] {line}"
                 for f in files for n, kind, line in diary_lines(f.read_text(encoding="utf-8"))]
    assert not offenders, "lines that date themselves (state the fact; docs/results/ says where and when):\n" + \
        "\n".join(offenders)


@pytest.mark.parametrize("line", [
    "# On the H200 (2026-12-02) a step took 4.6 ms",
    "see docs/results/h200-2026-12-04/bench.json",
    "multi-GPU runs are a separate issue",
    "(issue 38)",
    "The fourteenth round had no device",
    "measured in this session",
    "the next session re-runs it",
    "the third session measured it",
    '"measured_at": "2026-12-01T17:32:53+00:00"',
])
def test_detector_flags_each_diary_form(line: str) -> None:
    """Each way a line dates itself is caught."""
    assert diary_lines(line), line


@pytest.mark.parametrize("line", [
    "every collective is launched by every rank",
    "the run's gloo session for the asked layout",
    "EndpointSession(base_url)",
    "rounded up to a multiple of an eighth of its power of two",
    "the first token after 18.6 s; the second request",
    "kl-48b-8l on the H200 at 64 rows",
    "the drafter needs these tokens next round",
    "The session, when its asked layout has something to mis-slice",
])
def test_detector_passes_plain_facts(line: str) -> None:
    """Facts about the code and the hardware are not diary lines (no false alarms on the package's own words)."""
    assert not diary_lines(line), diary_lines(line)
