"""The product speaks of itself only: no line of the package or of README.md says when, in which result folder or
in which round of work something was measured or changed. Such a line names a date, a result folder
(`h200-...`), an issue, an ordinal round of work ("the thirteenth ...") or "this/next session"; where and when a
number was measured belongs in docs/results/ (docs/results/README.md indexes the runs).

Nor does the package's code tell lab stories: a comment or string naming a card next to a measured figure ("on the
H200 it took 4.6 ms", "measured 7.4e-4 on an H200"), something a run "saw", a measured timing with its unit
("18.6 s", "3.4-4.7 ms", "took 29 ms") or a pointer into lab/ (which does not ship). The code states the rationale;
the figures and the runs behind them live in docs/results/ and lab/. Words of the harness itself are not stories
("measured noise", a constant like `H200_GIB`, a timeout of "10 s")."""

from __future__ import annotations

import io
import re
import tokenize
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

CARD = r"(?<![\w-])(?:H100|H200|H800|A100|B200|GH200|L40S?|MI300X?)(?!\w)"
_UNIT = r"(?:ms|µs|us|ns|s|min|tok/s|tokens/s|GB/s|GiB/s|TB/s)(?![\w/])"
_NUMBER = r"(?<![\w.])\d+(?:\.\d+)?"
# a figure as measured: with decimals, a range or "~" (an integer alone is a setting: "5 ms", "a 10 s timeout")
_MEASURED_TIME = (rf"(?:~\s?{_NUMBER}|{_NUMBER}\s?(?:-|–|to|/)\s?{_NUMBER}|(?<![\w.])\d+\.\d+)\s?{_UNIT}"
                  rf"|\b(?:took|takes|waited|spent|measured|ran in|costs?)\b[^.;]{{0,40}}?{_NUMBER}\s?{_UNIT}")
_MEASURED_FIGURE = rf"{_MEASURED_TIME}|{_NUMBER}\s?%|\d(?:\.\d+)?e-\d+|{_NUMBER}x\b|\b(?:measured|showed|found|took)\b"
# name -> pattern; each names one way a comment or string of the package tells a lab story
STORY: dict[str, str] = {
    "card with a measured figure": rf"{CARD}.*(?:{_MEASURED_FIGURE})|(?:{_MEASURED_FIGURE}).*{CARD}"
                                   rf"|\b(?:on|from)\s+(?:the|an?)\s+{CARD}",
    "saw": r"\bsaw\b",
    "measured timing": _MEASURED_TIME,
    "pointer into lab/": r"(?<![\w/.])lab/",
}
_STORY = {name: re.compile(p, re.IGNORECASE if name == "saw" else 0) for name, p in STORY.items()}


def prose(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and every line of every string literal of a Python source."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            out += [(tok.start[0] + k, text) for k, text in enumerate(tok.string.splitlines())]
    return out


def story_lines(source: str) -> list[tuple[int, str, str]]:
    """(line number, kind, text) for every comment or string line of `source` that tells a lab story."""
    found = []
    for n, text in prose(source):
        for name, pattern in _STORY.items():
            if pattern.search(text):
                found.append((n, name, text.strip()[:160]))
                break
    return found


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


# path under k3verify/ -> how many story lines it still holds, to be rewritten (the exact count: a new story line
# fails, and so does a fixed one until its count here is lowered; an entry at 0 is deleted)
PENDING: dict[str, int] = {}


def test_package_code_tells_no_lab_story() -> None:
    """Every .py file under k3verify/: no comment or string names a card beside a measured figure, says what a run
    saw, gives a measured timing or points into lab/ (a file in PENDING holds exactly its count of such lines)."""
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 200, f"expected the package's modules; found {len(files)}"
    found = {f.relative_to(PACKAGE).as_posix(): story_lines(f.read_text(encoding="utf-8")) for f in files}
    offenders = [f"k3verify/{name}:{n}: [{kind}] {text}" for name, lines in found.items()
                 if len(lines) != PENDING.get(name, 0) for n, kind, text in lines]
    miscounted = {name: (count, len(found.get(name, []))) for name, count in PENDING.items()
                  if len(found.get(name, [])) != count}
    assert not offenders and not miscounted, (
        "lines that tell a lab story (state the rationale; the figures and runs belong in docs/results/ or lab/):\n"
        + "\n".join(offenders) + f"\nPENDING counts (listed, found): {miscounted}")


@pytest.mark.parametrize("line", [
    "# On the H200 a kl-48b-8l step took 4.6 ms",
    "# kl-48b-8l on the H200 at 64 rows",
    '"""64 free-running clients saw a first token after 18.6 s."""',
    "# the first token after 18.6 s; the second request",
    "# bursts arrived over 27-40 ms with gaps of up to 3.4-4.7 ms",
    "# a prefill took 29 ms of wall time",
    "# every small fp32 GEMM ~20 ms instead of ~10 us",
    'bar_reason="1.02e-7 on the H200, k3-syn-25"',
    '"""TF32 (measured 7.4e-4 on an H200)"""',
    "# the H200 showed 15% of elements beyond the bf16 bar",
    "# (lab/gpu/score_tune.py sweeps it)",
])
def test_story_detector_flags_each_form(line: str) -> None:
    """Each way a line of code tells a lab story is caught (as a comment or as a string)."""
    assert story_lines(line + "\n"), line


@pytest.mark.parametrize("line", [
    "# the bar derives from measured noise (gates/core/noise.py)",
    "H200_GIB = 141  # what torch reports for one H200 (141 GB of HBM3e, less the driver's reserve)",
    '"""a K3-shaped slice that fits one H200 (~12 GB)."""',
    "# CPython's default switch interval: 5 ms",
    '"""the front end is back within 10 s on the same port"""',
    "timeout_s = 600  # per child process",
    "# 503s and error events",
    '"""tests/lab/test_http_ceiling.py re-measures it; the bar is 3x that spread"""',
    "# a flip within 4x the oracle's own dtype noise",
    'msg = f"waited {elapsed:.1f} s"',
])
def test_story_detector_passes_the_harness_own_words(line: str) -> None:
    """The harness's own vocabulary and settings are not stories (no false alarm)."""
    assert not story_lines(line + "\n"), story_lines(line + "\n")
