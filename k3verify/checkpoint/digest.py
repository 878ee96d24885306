"""The checkpoint digest that reports record and `serve` matches: "sha256:<64 hex>".

It covers what decides the model's identity cheaply: config.json, generation_config.json (eos
handling), the index json (names -> shards) or, for a single-file checkpoint, that file's header,
every shard's header (names, dtypes, shapes, offsets), a sample of every shard's data (the first
and last 256 KiB: a different seed or a fine-tune changes them), and the tokenizer files. The data
is not hashed whole (a 1.4 TiB read per `serve` start is not affordable): an edit confined to the
middle of a shard keeps the digest.

Each item enters as `<label> NUL <byte length> NUL <bytes>`, in a fixed order (config files, index,
per shard in name order: header then data samples, tokenizer files in name order), so the digest
does not depend on directory listing order.
"""

from __future__ import annotations

import fnmatch
import hashlib
from pathlib import Path

from k3verify.checkpoint.reader import CheckpointError, read_header_bytes, read_index
from k3verify.checkpoint.writer import INDEX_FILE

DATA_SAMPLE_BYTES = 256 * 1024
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_PATTERNS = ("tiktoken.model", "*.tiktoken", "tokenizer*.json", "tokenizer.model", "special_tokens_map.json",
                      "added_tokens.json", "vocab.json", "merges.txt", "chat_template*", "tokenization_*.py")


def tokenizer_files(ckpt_dir: Path) -> list[Path]:
    """Tokenizer assets at the top level of a checkpoint dir, in name order."""
    return sorted(p for p in ckpt_dir.iterdir()
                  if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in TOKENIZER_PATTERNS))


def _feed(h: hashlib._Hash, rel: str, data: bytes) -> None:
    h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0")
    h.update(data)


def _data_samples(path: Path, data_start: int) -> bytes:
    with open(path, "rb") as fh:
        size = fh.seek(0, 2)
        head_end = min(size, data_start + DATA_SAMPLE_BYTES)
        fh.seek(data_start)
        head = fh.read(head_end - data_start)
        tail_start = max(head_end, size - DATA_SAMPLE_BYTES)
        fh.seek(tail_start)
        return head + fh.read(size - tail_start)


def checkpoint_digest(ckpt_dir: str | Path) -> str:
    """sha256 over config + index + shard headers and data samples + tokenizer files (see module doc)."""
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "config.json").is_file():
        raise CheckpointError(f"{ckpt_dir / 'config.json'}: missing (a checkpoint dir needs its config)")
    h = hashlib.sha256()
    for rel in CONFIG_FILES:
        if (ckpt_dir / rel).is_file():
            _feed(h, rel, (ckpt_dir / rel).read_bytes())
    index = read_index(ckpt_dir)
    if (ckpt_dir / INDEX_FILE).is_file():
        _feed(h, INDEX_FILE, (ckpt_dir / INDEX_FILE).read_bytes())
    for file in sorted(set(index.weight_map.values())):
        header = read_header_bytes(ckpt_dir / file)
        _feed(h, f"{file}#header", header)
        _feed(h, f"{file}#data-samples", _data_samples(ckpt_dir / file, len(header)))
    for path in tokenizer_files(ckpt_dir):
        _feed(h, path.name, path.read_bytes())
    return f"sha256:{h.hexdigest()}"
