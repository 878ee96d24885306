"""What binds a report to what it vouches for, beyond its own say-so.

- `source_digest()`: a sha256 over every file of the installed k3verify package, recorded in the run record,
  so a report vouches only for the exact code that produced it (an edited check, an edited gate) and `serve`
  matches it like the checkpoint digest.
- `recompute_summary(data)`: the counts and verdict a report's results imply; a summary that disagrees with
  its own results (results edited to "fail", verdict left "pass") is refused.
- `sign_report` / `signature_problem`: an optional HMAC-SHA256 over the report's canonical JSON with a local
  key (`parity --report-key FILE` signs, `serve --report-key FILE` refuses anything unsigned or edited).

Without a key, an edited report is caught only where the edit leaves an inconsistency (the recomputed
summary, the digests); with a key, any edit is caught. README: "Threat model".
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import k3verify
from k3verify.gates.core.evidence import missing_evidence

STATUSES = ("pass", "excused", "fail", "vacuous", "error", "skipped")
HMAC_ALG = "hmac-sha256"
MIN_KEY_BYTES = 16


def verdict_from_counts(counts: Mapping[str, int], setup_error: str | None = None,
                        missing: Sequence[str] = ()) -> str:
    """"error" when the run never got to its checks; "fail" when anything failed, was vacuous or errored;
    "inconclusive" when nothing did but the checks that compare the model's outputs did not run (gates/core/evidence.py:
    an all-skipped run proves nothing either); else "pass". An excused result ("pass, N roundings excused") is a
    pass here: its count stays visible in the summary and on the result."""
    if setup_error is not None:
        return "error"
    if counts["fail"] + counts["vacuous"] + counts["error"]:
        return "fail"
    passed = counts["pass"] + counts.get("excused", 0)
    return "inconclusive" if missing or passed == 0 else "pass"


def dtypes_of_run(results: Iterable[tuple[str, Iterable[str]]]) -> list[str]:
    """A run's `dtypes` from its results' (status, serving_dtypes): the dtypes that checks which ran (not skipped)
    built the served model in, sorted. parity records it; serve recomputes it from the results."""
    return sorted({d for status, dtypes in results if status != "skipped" for d in dtypes})


@cache
def source_digest(package_dir: str | None = None) -> str:
    """sha256 over `<relative path> NUL <size> NUL <sha256>` of every file of the package (bytecode caches
    excluded), in path order: any edit to the code that runs the gates or serves gives another digest."""
    root = Path(package_dir or Path(k3verify.__file__).parent)
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if "__pycache__" in rel.split("/") or rel.endswith((".pyc", ".pyo")):
            continue
        data = path.read_bytes()
        h.update(f"{rel}\0{len(data)}\0{hashlib.sha256(data).hexdigest()}\n".encode())
    return f"sha256:{h.hexdigest()}"


def recompute_summary(data: Mapping[str, Any]) -> dict[str, Any]:
    """The summary a report's results imply: counts by status, total, verdict (setup_error kept)."""
    counts = dict.fromkeys(STATUSES, 0)
    for result in data["results"]:
        counts[result["status"]] += 1
    setup_error = data["summary"].get("setup_error")
    missing = [] if setup_error is not None else missing_evidence(data["results"])
    out: dict[str, Any] = {"counts": counts, "total": len(data["results"]),
                           "verdict": verdict_from_counts(counts, setup_error, missing)}
    if setup_error is not None:
        out["setup_error"] = setup_error
    if missing:
        out["missing_evidence"] = missing
    return out


def summary_problem(data: Mapping[str, Any]) -> str | None:
    """Why a report's summary cannot be believed (it disagrees with its own results), or None."""
    claimed, implied = dict(data["summary"]), recompute_summary(data)
    if isinstance(claimed.get("counts"), Mapping):  # a report written before "excused" existed counts none
        claimed["counts"] = {**dict.fromkeys(STATUSES, 0), **claimed["counts"]}
    for key in ("verdict", "counts", "total", "missing_evidence"):
        if claimed.get(key) != implied.get(key):
            return (f"its summary.{key} {claimed.get(key)!r} contradicts its results, which give {implied.get(key)!r} "
                    "(the report was edited)")
    return None


def _canonical(data: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in data.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode()


def key_id(key: bytes) -> str:
    """A short public name for a key (so a refusal can say which key signed a report), not the key."""
    return hashlib.sha256(b"k3verify-report-key\0" + key).hexdigest()[:16]


def read_report_key(path: str | Path) -> bytes:
    """The key bytes of a key file (surrounding whitespace stripped); ValueError naming the file if unusable."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"report key file {path}: cannot be read: {exc.strerror or exc}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"report key file {path}: holds {len(key)} bytes; a key needs at least {MIN_KEY_BYTES} "
                         "(e.g. `head -c 32 /dev/urandom | base64 > FILE`)")
    return key


def sign_report(data: dict[str, Any], key: bytes) -> dict[str, Any]:
    """data with a `signature` {alg, key_id, mac} over its canonical JSON (any previous signature replaced)."""
    mac = hmac.new(key, _canonical(data), hashlib.sha256).hexdigest()
    return {k: v for k, v in data.items() if k != "signature"} | {
        "signature": {"alg": HMAC_ALG, "key_id": key_id(key), "mac": mac}}


def signature_problem(data: Mapping[str, Any], key: bytes) -> str | None:
    """Why a report's signature does not hold under `key` (unsigned, another key, edited), or None."""
    sig = data.get("signature")
    if not isinstance(sig, Mapping):
        return "it is not signed"
    if sig.get("alg") != HMAC_ALG:
        return f"its signature uses {sig.get('alg')!r}, not {HMAC_ALG}"
    if sig.get("key_id") != key_id(key):
        return f"it was signed with key {sig.get('key_id')}, not this key ({key_id(key)})"
    want = hmac.new(key, _canonical(data), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(str(sig.get("mac", "")), want):
        return "its signature does not match its content (the report was edited after signing)"
    return None
