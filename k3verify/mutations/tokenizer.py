"""Tokenizer and chat faults: special-token injection, the long-input split, the pre-tokenizer, streaming."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

TOK = "k3verify.tokenizer.tokenizer"
CHAT = "k3verify.tokenizer.chat"

MUTANTS = [
    Mutant(
        id="tokenizer.special_tokens_in_user_text", quick=True,
        fault="chat content is encoded with specials allowed, so a user typing [EOS] or <|im_end|> injects the token",
        target="k3verify.tokenizer.jinja_chat:_encode_rendered",
        old="return ids + tokenizer.encode(user) + template_text(text[pos:])",
        new="return ids + tokenizer.encode(user, allow_special=True) + template_text(text[pos:])",
        killers=["tokenizer.chat.user_text_plain"],
    ),
    Mutant(
        id="tokenizer.encode_always_parses_specials",
        fault="encode() turns special-token names into special ids even when allow_special is False",
        target=f"{TOK}:KimiTokenizer.encode",
        old="        if not allow_special:\n            return self._encode_plain(text)\n",
        new="",
        killers=["tokenizer.encode.user_text_plain", "tokenizer.encode.exact_ids", "tokenizer.chat.user_text_plain"],
    ),
    Mutant(
        id="tokenizer.split_run_cap_ignored",
        fault="long-input splitting ignores the per-run cap, so over-long whitespace runs reach tiktoken whole",
        target=f"{TOK}:split_for_encoding",
        old="for pos in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):",
        new="for pos in range(run.start() + MAX_RUN_CHARS, run.start(), MAX_RUN_CHARS):",
        killers=["tokenizer.encode.long_runs"],
    ),
    Mutant(
        id="tokenizer.pretokenizer_digits_unbounded",
        fault="the pre-tokenizer groups any number of digits (\\p{N}+) instead of at most three",
        target=f"{TOK}:PAT_STR",
        old='r"\\p{N}{1,3}",',
        new='r"\\p{N}+",',
        killers=["tokenizer.encode.exact_ids", "tokenizer.encode.long_runs", "tokenizer.chat.render"],
    ),
    Mutant(
        id="tokenizer.chat_role_word_dropped",
        fault="chat turns render the marker without the role word (<|im_user|><|im_middle|>...)",
        target=f"{CHAT}:render_chat",
        old="        text(name or role)\n",
        new="",
        killers=["tokenizer.chat.render", "tokenizer.chat.user_text_plain"],
    ),
    Mutant(
        id="tokenizer.stream_skip_special_ignored",
        fault="the streaming decoder emits special tokens' text even when asked to skip them",
        target="k3verify.tokenizer.streaming:IncrementalDecoder.push",
        old="if self.skip_special and self.tokenizer.is_special(token_id):",
        new="if False:",
        killers=["tokenizer.stream.incremental"],
    ),
]
