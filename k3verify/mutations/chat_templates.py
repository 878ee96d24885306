"""Faults in rendering a checkpoint's own Jinja chat template (k3verify/tokenizer/jinja_chat.py)."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

MUTANTS = [
    Mutant(
        id="chat_template.user_text_unprotected", quick=True,
        fault="user text is handed to the template as is (no sentinel), so a typed [EOS] or <|im_end|> is encoded "
              "as a special token",
        target="k3verify.tokenizer.jinja_chat:_Protector.__call__",
        old='return f"K3VS{self.nonce}N{len(self.texts) - 1}Z"',
        new="return text",
        killers=["tokenizer.chat.*"],
    ),
    Mutant(
        id="chat_template.parts_encoded_apart",
        fault="adjacent content parts are encoded one by one instead of as their concatenation",
        target="k3verify.tokenizer.jinja_chat:_encode_rendered",
        old="        if start > pos:\n",
        new="        if True:\n",
        killers=["tokenizer.chat.*"],
    ),
]
