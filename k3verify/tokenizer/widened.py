"""The project's tokenizer widened to a real vocabulary's id layout, for checkpoints of real shapes.

Real configs name bos/eos/pad at ids 163584+ (SPEC §7: N = 163584 base tokens, then 258 special slots). The
project's vocabulary (assets/, N = 4096) keeps its ranks 0..4095; ranks 4096..N-1 are filler tokens that no text
can produce (each begins with byte 0xF8, which never occurs in UTF-8), and every special keeps its offset from N.
So a real-shape checkpoint ships a tokenizer whose special ids match its config, deterministically.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from k3verify.tokenizer.tokenizer import ASSETS_DIR, CONFIG_FILE, MODEL_FILE

_FILLER_LEAD = b"\xf8"  # not a UTF-8 byte: encoding text never reaches a filler token


def _filler_line(rank: int) -> str:
    return f"{base64.b64encode(_FILLER_LEAD + rank.to_bytes(3, 'big')).decode()} {rank}\n"


def write_widened_tokenizer(out_dir: Path, num_base: int) -> None:
    """tiktoken.model and tokenizer_config.json for `num_base` base tokens (>= the project's), specials at
    num_base + (their offset in the project's vocabulary)."""
    lines = (ASSETS_DIR / MODEL_FILE).read_text(encoding="ascii").splitlines(keepends=True)
    base = len([line for line in lines if line.strip()])
    if num_base < base:
        raise ValueError(f"cannot widen the project's {base}-token vocabulary to {num_base} base tokens")
    if num_base >= 1 << 24:
        raise ValueError(f"num_base {num_base} exceeds the 3-byte filler space")
    with open(out_dir / MODEL_FILE, "w", encoding="ascii") as fh:
        fh.writelines(lines)
        fh.writelines(_filler_line(rank) for rank in range(base, num_base))
    config = json.loads((ASSETS_DIR / CONFIG_FILE).read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {str(int(i) - base + num_base): entry
                                      for i, entry in config["added_tokens_decoder"].items()}
    config["built_by"] = f"{config.get('built_by', 'k3verify')} + k3verify.tokenizer.widened ({base} -> {num_base})"
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                                       encoding="utf-8")
