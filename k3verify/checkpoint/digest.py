"""The checkpoint digest that reports record and `serve` matches: "sha256:<64 hex>".

It covers every byte of every file that decides the model: config.json, generation_config.json (eos
handling), the index json (names -> shards), every shard the index names (whole: headers and data), and
the tokenizer files. Each file is hashed whole with a streamed sha256; the digest is a sha256 over
`<name> NUL <size> NUL <file sha256>` per file in a fixed order (config files, index, shards in name
order, tokenizer files in name order), so it does not depend on directory listing order.

Hashing a 1.4 TiB checkpoint takes minutes, so per-file hashes are cached (`digests.json` beside the
checkpoint cache) under the file's path, size, mtime_ns, ctime_ns and inode: an in-place edit changes
ctime even when `touch -r` restores mtime, and a replaced file has another inode. A file changed within
RACY_S of being hashed is not cached (a later edit could land in the same timestamp tick).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3verify.checkpoint.reader import CheckpointError, read_index
from k3verify.checkpoint.writer import INDEX_FILE

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
RACY_S = 2.0
CACHE_VERSION = 1
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_PATTERNS = ("tiktoken.model", "*.tiktoken", "tokenizer*.json", "tokenizer.model", "special_tokens_map.json",
                      "added_tokens.json", "vocab.json", "merges.txt", "chat_template*", "tokenization_*.py")


def tokenizer_files(ckpt_dir: Path) -> list[Path]:
    """Tokenizer assets at the top level of a checkpoint dir, in name order."""
    return sorted(p for p in ckpt_dir.iterdir()
                  if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in TOKENIZER_PATTERNS))


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def default_cache_path() -> Path:
    """`digests.json` next to the synthetic checkpoint cache (`$K3V_CACHE_DIR`, else ~/.cache/k3verify)."""
    from k3verify.checkpoint.synthetic import default_cache_root

    return default_cache_root().parent / "digests.json"


@dataclass
class DigestCache:
    """Per-file sha256 keyed by resolved path, valid only while (size, mtime_ns, ctime_ns, inode) are unchanged.
    `path=None` keeps it in memory only."""

    path: Path | None
    racy_s: float = RACY_S
    clock: Callable[[], float] = time.time
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    dirty: bool = False

    @classmethod
    def load(cls, path: Path | None = None) -> DigestCache:
        path = default_cache_path() if path is None else path
        cache = cls(path)
        with contextlib.suppress(FileNotFoundError):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if data.get("version") == CACHE_VERSION and isinstance(data.get("entries"), dict):
                    cache.entries = data["entries"]
            except (OSError, ValueError, AttributeError) as exc:
                log.warning("ignoring the digest cache %s (%s): every file is hashed again", path, exc)
        return cache

    def lookup(self, file: Path, st: os.stat_result) -> str | None:
        hit = self.entries.get(str(file))
        return str(hit["sha256"]) if hit and hit.get("stat") == _stat_key(st) else None

    def store(self, file: Path, st: os.stat_result, sha: str) -> None:
        if self.clock() - max(st.st_mtime_ns, st.st_ctime_ns) / 1e9 < self.racy_s:
            return
        self.entries[str(file)] = {"stat": _stat_key(st), "sha256": sha}
        self.dirty = True

    def save(self) -> None:
        """Write the cache atomically (a failure to write costs only speed: logged, not raised)."""
        if self.path is None or not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".digests.", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"version": CACHE_VERSION, "entries": self.entries}, fh)
            os.replace(tmp, self.path)
            self.dirty = False
        except OSError as exc:
            log.warning("could not write the digest cache %s: %s", self.path, exc)


def file_sha256(path: Path, cache: DigestCache) -> tuple[int, str]:
    """(size, sha256 hex) of a file's every byte, from the cache when its stat key is unchanged."""
    try:
        with open(path, "rb") as fh:
            before = os.fstat(fh.fileno())
            path = path.resolve()
            cached = cache.lookup(path, before)
            if cached is not None:
                return before.st_size, cached
            h = hashlib.sha256()
            buf = bytearray(CHUNK_BYTES)
            view = memoryview(buf)
            while n := fh.readinto(buf):
                h.update(view[:n])
            after = os.fstat(fh.fileno())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the checkpoint needs this file)") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    sha = h.hexdigest()
    if _stat_key(after) == _stat_key(before):  # not modified while it was being read
        cache.store(path, after, sha)
    return after.st_size, sha


def covered_files(ckpt_dir: Path) -> list[Path]:
    """The files the digest covers, in digest order (config files, index, shards, tokenizer files)."""
    if not (ckpt_dir / "config.json").is_file():
        raise CheckpointError(f"{ckpt_dir / 'config.json'}: missing (a checkpoint dir needs its config)")
    files = [ckpt_dir / rel for rel in CONFIG_FILES if (ckpt_dir / rel).is_file()]
    index = read_index(ckpt_dir)
    if (ckpt_dir / INDEX_FILE).is_file():
        files.append(ckpt_dir / INDEX_FILE)
    files += [ckpt_dir / shard for shard in sorted(set(index.weight_map.values()))]
    return files + tokenizer_files(ckpt_dir)


def digest_of(files: Iterable[tuple[str, int, str]]) -> str:
    """The checkpoint digest of (relative name, size, sha256 hex) per covered file, in digest order."""
    h = hashlib.sha256()
    for name, size, sha in files:
        h.update(f"{name}\0{size}\0{sha}\n".encode())
    return f"sha256:{h.hexdigest()}"


def checkpoint_digest(ckpt_dir: str | Path, cache: DigestCache | None = None) -> str:
    """sha256 over every covered file's full-content sha256 (see module doc); `cache` defaults to the on-disk one."""
    ckpt_dir = Path(ckpt_dir)
    cache = DigestCache.load() if cache is None else cache
    rows = [(str(path.relative_to(ckpt_dir)), *file_sha256(path, cache)) for path in covered_files(ckpt_dir)]
    cache.save()
    return digest_of(rows)
