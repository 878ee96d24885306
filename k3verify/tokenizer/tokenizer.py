"""KimiTokenizer: tiktoken BPE over the Kimi pre-tokenizer, special tokens from tokenizer_config.json."""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import tiktoken

from k3verify.tokenizer.templates import chat_format_of

# SPEC §7, verbatim. tiktoken compiles it with fancy-regex, whose non-lookaround parts go to the Rust
# `regex` crate, which supports the `&&` class intersection, so no rewrite is needed. Python's
# `regex` module reads the same syntax only with the V1 flag (V0 treats `&&` as literal text).
PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

NUM_SPECIAL_SLOTS = 258  # ids N … N+257, as in the released vocab
MAX_CHARS_PER_CALL = 400_000
MAX_RUN_CHARS = 25_000  # tiktoken can panic on longer whitespace / non-whitespace runs

CHAT_MARKERS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")

MODEL_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
ASSETS_DIR = Path(__file__).parent / "assets"

_RUN_RE = re.compile(r"\s+|\S+")


def reserved_token_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def split_for_encoding(text: str) -> Iterator[str]:
    """Cut `text` into pieces of ≤ MAX_CHARS_PER_CALL chars whose whitespace / non-whitespace runs are ≤ MAX_RUN_CHARS.

    Cuts fall only inside over-long runs (plus every MAX_CHARS_PER_CALL chars), so ordinary text is one piece
    and encodes exactly as if unsplit.
    """
    for start in range(0, len(text), MAX_CHARS_PER_CALL):
        chunk = text[start : start + MAX_CHARS_PER_CALL]
        cut = 0
        for run in _RUN_RE.finditer(chunk):
            for pos in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield chunk[cut:pos]
                cut = pos
        yield chunk[cut:]


def load_mergeable_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file (`base64(token) rank` per line); ranks must be exactly 0 … N-1."""
    return parse_mergeable_ranks(path.read_bytes(), path)


def parse_mergeable_ranks(data: bytes, path: Path | str) -> dict[bytes, int]:
    """The ranks of a tiktoken BPE file's bytes (`path` names it in errors); see load_mergeable_ranks."""
    ranks: dict[bytes, int] = {}
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not an ASCII tiktoken file: {exc}") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line:
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError(f"expected 2 fields, got {len(fields)}")
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error) as exc:
            raise ValueError(f"{path}:{lineno}: malformed tiktoken line {line!r}: {exc}") from exc
        if token in ranks:
            raise ValueError(f"{path}:{lineno}: token {token!r} listed twice (ranks {ranks[token]} and {rank})")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be exactly 0..{len(ranks) - 1} with no gaps or repeats")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: {len(missing)} single bytes have no token (first: {missing[0]:#04x})")
    return ranks


def _token_content(value: object, *, field: str, source: Path | str) -> str:
    """HF writes special tokens either as a bare string or as an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f"{source}: {field} must be a string or {{'content': str}}; got {value!r}")
    return value


class KimiTokenizer:
    """Byte-level BPE (tiktoken) with the Kimi pre-tokenizer and N+258 special slots."""

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        special_names: dict[int, str],
        *,
        bos_token: str,
        eos_token: str,
        pad_token: str | None = None,
        chat_template: str | None = None,
        source: str = "<memory>",
    ) -> None:
        n_base = len(mergeable_ranks)
        self.mergeable_ranks = dict(mergeable_ranks)  # the BPE ranks as loaded: a GGUF vocabulary derives merges
        self.num_base_tokens = n_base
        self.n_vocab = n_base + NUM_SPECIAL_SLOTS
        self.source = source
        for token_id in special_names:
            if not n_base <= token_id < self.n_vocab:
                raise ValueError(f"{source}: special token id {token_id} outside {n_base}..{self.n_vocab - 1}")
        self.id_to_special = {i: special_names.get(i, reserved_token_name(i)) for i in range(n_base, self.n_vocab)}
        self.special_to_id = {name: i for i, name in self.id_to_special.items()}
        if len(self.special_to_id) != NUM_SPECIAL_SLOTS:
            raise ValueError(f"{source}: special token names are not unique: {sorted(special_names.values())}")
        for name in CHAT_MARKERS:
            if name not in self.special_to_id:
                raise ValueError(f"{source}: special token {name!r} missing from added_tokens_decoder")
        self.bos_id = self.special_id(bos_token)
        self.eos_id = self.special_id(eos_token)
        self.pad_id = None if pad_token is None else self.special_id(pad_token)
        self.im_end_id = self.special_to_id["<|im_end|>"]
        self.chat_template = chat_template
        self.chat_format = None if chat_template is None else chat_format_of(chat_template, source=source)
        self._enc = tiktoken.Encoding(
            name=f"kimi-{n_base}",
            pat_str=PAT_STR,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_to_id,
            explicit_n_vocab=self.n_vocab,
        )
        # Longest first so no name can shadow a longer one sharing its prefix.
        names = sorted(self.special_to_id, key=lambda s: (-len(s), s))
        self._special_re = re.compile("|".join(re.escape(n) for n in names))

    @classmethod
    def from_files(cls, model_path: Path, config_path: Path) -> KimiTokenizer:
        """Load from an explicit `tiktoken.model` and `tokenizer_config.json`; never looks anywhere else."""
        model_path, config_path = Path(model_path), Path(config_path)
        for path in (model_path, config_path):
            if not path.is_file():
                raise FileNotFoundError(f"tokenizer file not found: {path}")
        return cls.from_bytes(model_path.read_bytes(), config_path.read_bytes(), model_path, config_path)

    @classmethod
    def from_bytes(cls, model: bytes, config_bytes: bytes, model_path: Path | str = MODEL_FILE,
                   config_path: Path | str = CONFIG_FILE) -> KimiTokenizer:
        """Build from the bytes of a `tiktoken.model` and a `tokenizer_config.json` (the paths only name them in
        errors and in `source`): what `serve` does with the very bytes its checkpoint digest covered."""
        ranks = parse_mergeable_ranks(model, model_path)
        try:
            config = json.loads(config_bytes.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{config_path}: not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: must hold a JSON object; got {type(config).__name__}")
        decoder = config.get("added_tokens_decoder")
        if not isinstance(decoder, dict):
            raise ValueError(f"{config_path}: added_tokens_decoder must be an object mapping id → token")
        special_names: dict[int, str] = {}
        for key, entry in decoder.items():
            if not (isinstance(key, str) and key.isdigit()):
                raise ValueError(f"{config_path}: added_tokens_decoder key {key!r} is not a token id")
            special_names[int(key)] = _token_content(entry, field=f"added_tokens_decoder[{key}]", source=config_path)
        for field in ("bos_token", "eos_token"):
            if field not in config:
                raise ValueError(f"{config_path}: {field} missing")
        pad = config.get("pad_token")
        return cls(
            ranks,
            special_names,
            bos_token=_token_content(config["bos_token"], field="bos_token", source=config_path),
            eos_token=_token_content(config["eos_token"], field="eos_token", source=config_path),
            pad_token=None if pad is None else _token_content(pad, field="pad_token", source=config_path),
            chat_template=config.get("chat_template"),
            source=str(config_path),
        )

    @classmethod
    def from_dir(cls, directory: Path) -> KimiTokenizer:
        """Load `directory/tiktoken.model` and `directory/tokenizer_config.json`."""
        directory = Path(directory)
        return cls.from_files(directory / MODEL_FILE, directory / CONFIG_FILE)

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The underlying tiktoken encoding (no long-input splitting: prefer `encode`)."""
        return self._enc

    def special_id(self, name: str) -> int:
        try:
            return self.special_to_id[name]
        except KeyError:
            raise ValueError(f"{self.source}: no special token named {name!r}") from None

    def is_special(self, token_id: int) -> bool:
        return self.num_base_tokens <= token_id < self.n_vocab

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of `text`; special-token names become special ids only when `allow_special`."""
        if not allow_special:
            return self._encode_plain(text)
        ids: list[int] = []
        pos = 0
        for match in self._special_re.finditer(text):
            ids += self._encode_plain(text[pos : match.start()])
            ids.append(self.special_to_id[match.group()])
            pos = match.end()
        ids += self._encode_plain(text[pos:])
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in split_for_encoding(text):
            ids += self._enc.encode_ordinary(piece)
        return ids

    def decode_bytes(self, ids: Sequence[int], *, skip_special: bool = False) -> bytes:
        """Raw bytes of `ids` (special ids as their names' UTF-8); may end mid-character."""
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ValueError(f"token ids outside 0..{self.n_vocab - 1}: {bad[:5]}")
        if skip_special:
            ids = [i for i in ids if not self.is_special(i)]
        return self._enc.decode_bytes(list(ids))

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode_bytes([token_id])


@functools.cache
def default_tokenizer() -> KimiTokenizer:
    """The vocabulary this project builds (tools/build_tokenizer.py) and ships in assets/."""
    return KimiTokenizer.from_dir(ASSETS_DIR)
