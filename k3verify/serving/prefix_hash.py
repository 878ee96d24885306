"""Block hashes of a prompt for the prefix cache: each block of `block` tokens is hashed together with the hash of
everything before it, so equal blocks under different prefixes never share an entry.

The chain starts at a root that names what the cached values depend on besides the tokens: the weights the
engine serves (a reload changes them) and, with per-key isolation, the API key. Hashes are blake2b digests of
16 bytes over the parent digest and the block's token ids as little-endian int64.
"""

from __future__ import annotations

import hashlib

import torch

DIGEST = 16  # bytes


def root_hash(weights: str, generation: int, key: str | None = None) -> bytes:
    """The chain's root: the served weights' digest, how many times they were (re)loaded, and the API key
    (only when entries are isolated per key)."""
    h = hashlib.blake2b(digest_size=DIGEST)
    h.update(f"weights={weights};generation={generation};".encode())
    if key is not None:
        h.update(b"key=" + hashlib.sha256(key.encode()).digest())
    return h.digest()


def _digest(parent: bytes, tokens: list[int], tag: bytes) -> bytes:
    h = hashlib.blake2b(parent + tag, digest_size=DIGEST)
    h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    return h.digest()


def block_hashes(tokens: list[int], block: int, root: bytes) -> list[bytes]:
    """One hash per full block of `tokens` (a trailing partial block has none), each chained with its parent's."""
    if block < 1:
        raise ValueError(f"block must be >= 1 token; got {block}")
    out, parent = [], root
    for start in range(0, len(tokens) - block + 1, block):
        parent = _digest(parent, tokens[start:start + block], b"B")
        out.append(parent)
    return out


def whole_hash(tokens: list[int], block: int, root: bytes) -> bytes:
    """The key of a whole-prompt entry: the chain through the prompt's full blocks, then its tail, marked apart
    from a block's hash (a prompt of exactly one block differs from that block as a prefix)."""
    chain = block_hashes(tokens, block, root)
    start = len(chain) * block
    return _digest(chain[-1] if chain else root, tokens[start:] + [len(tokens)], b"W")
