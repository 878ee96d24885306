"""The report index: an append-only `report-index.jsonl` that k3verify writes beside every report.json it writes.

One line per report written into that directory: a sequence number (1, 2, ... in that file), the sha256 of the
report.json bytes as written, when k3verify wrote it, and what the run binds (digest, version, source, device,
preset, dtypes, and whether it was narrowed or an endpoint run). `serve` orders reports by the index, never by a
field of the report (the report is what an editor changes): within a directory the sequence decides, across
directories the index's own write times do. A report.json whose bytes are not its index's latest entry was edited
or put back after k3verify wrote it, and a matching entry newer than the report that would open the gate closes it
even when its report.json is gone or edited. Threat model: README "Serving safely".
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

INDEX_FILE = "report-index.jsonl"
REPORT_FILE = "report.json"
BINDING_KEYS = ("checkpoint_digest", "k3verify_version", "source_digest", "device", "preset", "dtypes")


class ReportIndexError(ValueError):
    """An index file that is not what k3verify writes (a malformed line, a sequence that does not count up)."""


@dataclass(frozen=True)
class IndexEntry:
    """One report written into the index's directory."""

    seq: int
    sha256: str
    written_at: str  # ISO 8601 UTC, microseconds: k3verify's clock when it appended this line
    run: dict[str, Any]  # BINDING_KEYS of the run record, plus "narrowed" and "endpoint" (booleans)
    signature: str | None = None  # with a report key: HMAC-SHA256 over the line's other fields (line_mac)

    @property
    def order(self) -> tuple[str, int]:
        return self.written_at, self.seq

    def fields(self) -> dict[str, Any]:
        """The line as written, without its signature: what the signature covers."""
        return {"seq": self.seq, "sha256": self.sha256, "written_at": self.written_at, "run": self.run}


def content_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def binding_of(run: Mapping[str, Any]) -> dict[str, Any]:
    """What an index line records of a run record: what `serve` matches on."""
    out = {key: run.get(key) for key in BINDING_KEYS}
    out["narrowed"], out["endpoint"] = bool(run.get("only")), bool(run.get("endpoint"))
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[Any]:
    """The index open for appending, under an exclusive lock (two runs writing into one directory)."""
    with open(path, "a+", encoding="utf-8") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield fh
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def line_mac(fields: Mapping[str, Any], key: bytes) -> str:
    """HMAC-SHA256 under the report key over an index line's canonical JSON (its sequence, the report's sha256, the
    write time and the run it binds): an edited line no longer verifies."""
    canonical = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True)
    return hmac.new(key, b"k3verify-report-index\0" + canonical.encode(), hashlib.sha256).hexdigest()


def line_problem(entry: IndexEntry, key: bytes) -> str | None:
    """Why an index line's signature does not hold under `key` (unsigned, or edited after it was written), or None."""
    if entry.signature is None:
        return f"its index line (write #{entry.seq}) is not signed"
    if not hmac.compare_digest(entry.signature, line_mac(entry.fields(), key)):
        return (f"its index line (write #{entry.seq}) does not match its signature under this key: the line was "
                "edited after it was written, or signed with another key")
    return None


def append_entry(directory: str | Path, report_bytes: bytes, run: Mapping[str, Any],
                 key: bytes | None = None) -> IndexEntry:
    """Record that `report_bytes` was written as directory/report.json: the next sequence number, its sha256, now,
    the run it binds (signed with `key` when given)."""
    path = Path(directory) / INDEX_FILE
    with _locked(path) as fh:
        fh.seek(0)
        entries = parse_lines(fh.read(), path)
        entry = IndexEntry(entries[-1].seq + 1 if entries else 1, content_sha256(report_bytes),
                           datetime.now(UTC).isoformat(timespec="microseconds"), binding_of(run))
        line = entry.fields() | ({} if key is None else {"signature": line_mac(entry.fields(), key)})
        fh.seek(0, os.SEEK_END)
        fh.write(json.dumps(line, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return entry


def parse_lines(text: str, path: Path) -> list[IndexEntry]:
    """Every entry of an index's text; ReportIndexError naming the line when one is not what k3verify writes."""
    entries: list[IndexEntry] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        try:
            raw = json.loads(line)
            signature = raw.get("signature")
            entry = IndexEntry(int(raw["seq"]), str(raw["sha256"]), str(raw["written_at"]), dict(raw["run"]),
                               None if signature is None else str(signature))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ReportIndexError(f"{path}:{lineno}: not an index entry ({type(exc).__name__}: {exc})") from None
        if entry.seq != (entries[-1].seq + 1 if entries else 1):
            raise ReportIndexError(f"{path}:{lineno}: sequence {entry.seq} does not follow "
                              f"{entries[-1].seq if entries else 0}: the index was edited")
        entries.append(entry)
    return entries


def read_index(directory: Path) -> list[IndexEntry]:
    """The entries of directory's index (ReportIndexError if it is missing or malformed)."""
    path = directory / INDEX_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReportIndexError(f"{path} is missing: k3verify writes it with every report") from None
    entries = parse_lines(text, path)
    if not entries:
        raise ReportIndexError(f"{path} is empty: k3verify writes a line with every report")
    return entries


def binding_problem(entry: IndexEntry, run: Mapping[str, Any]) -> str | None:
    """Why the index line does not record the run its report.json holds, field by field (None: it does): an index
    line edited to name another checkpoint, preset or dtypes would otherwise make a genuine report vouch for it."""
    recorded = binding_of(run)
    for name in sorted(set(recorded) | set(entry.run)):
        if entry.run.get(name) != recorded.get(name):
            return (f"its index line (write #{entry.seq}) says {name} {entry.run.get(name)!r} but report.json's run "
                    f"says {recorded.get(name)!r}: the index was edited")
    return None


def content_problem(report_bytes: bytes, entries: list[IndexEntry]) -> str | None:
    """Why these report.json bytes are not the index's latest write (None: they are)."""
    sha = content_sha256(report_bytes)
    latest = entries[-1]
    if sha == latest.sha256:
        return None
    earlier = [e for e in entries if e.sha256 == sha]
    if earlier:
        return (f"its content is write #{earlier[-1].seq} of its index, but write #{latest.seq} came after it (an "
                "older report was put back)")
    return (f"its content (sha256 {sha[:16]}…) is not what k3verify wrote there (write #{latest.seq} has "
            f"{latest.sha256[:16]}…): it was edited after it was written")
