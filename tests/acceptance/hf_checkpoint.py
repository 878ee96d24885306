"""A tiny Kimi-Linear checkpoint written the way a user gets one: transformers 5.24 `save_pretrained` of a bf16
model (so router weights stay fp32, A_log comes out bf16, the dense layer's MLP is spelled block_sparse_moe.*),
config.json and generation_config.json naming the same eos, and a tiktoken vocabulary of its own (BPE merges
learned here from a small text, not the project's assets)."""

from __future__ import annotations

import base64
import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from k3verify.presets import preset_hf_config

CORPUS = ("the quick brown fox jumps over the lazy dog; a tiny model reads the text and writes the answer. "
          "hello world, tokens and merges, kimi linear attention with delta rules and experts. ") * 4
NUM_MERGES = 120
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>", "[PAD]"]
NUM_SPECIAL_SLOTS = 258
# Its own chat template (Jinja, not the project's): a system prompt line, tool results quoted by call id.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}<|im_system|>tool<|im_middle|>result of {{ m.tool_call_id }}: {{ m.content }}"
    "<|im_end|>{%- else -%}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>"
    "{%- if m.content is string -%}{{ m.content }}{%- elif m.content -%}{%- for p in m.content -%}{{ p.text }}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if m.tool_calls -%}<|tool_calls_section_begin|>{%- for c in m.tool_calls -%}<|tool_call_begin|>{{ c.id }}"
    "<|tool_call_argument_begin|>{{ c.function.arguments }}<|tool_call_end|>{%- endfor -%}"
    "<|tool_calls_section_end|>{%- endif -%}<|im_end|>{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def learn_merges(text: str, n: int) -> list[bytes]:
    """Byte-level BPE: the 256 bytes, then the `n` most frequent adjacent pairs merged in turn (ties by bytes)."""
    words = [[bytes([b]) for b in w.encode()] for w in text.replace(" ", "\0 ").split("\0")]
    tokens = [bytes([b]) for b in range(256)]
    for _ in range(n):
        pairs = Counter((a, b) for w in words for a, b in zip(w, w[1:], strict=False))
        if not pairs:
            break
        (a, b), _count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        tokens.append(a + b)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    return tokens


def write_tokenizer(out: Path, chat_template: str | None = CHAT_TEMPLATE) -> dict[str, int]:
    """tiktoken.model + tokenizer_config.json in `out`; returns {special name: id}."""
    tokens = learn_merges(CORPUS, NUM_MERGES)
    (out / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    n = len(tokens)
    ids = {name: n + i for i, name in enumerate(SPECIALS)}
    config: dict[str, Any] = {
        "added_tokens_decoder": {str(i): {"content": name, "special": True} for name, i in ids.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "tokenizer_class": "TikTokenTokenizer"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids | {"num_base": n}


def hf_tiny_config(specials: dict[str, int], kda_heads: int = 3) -> dict[str, Any]:
    """kl-tiny reshaped: 3 KDA heads (against 4 MLA heads), v_head 40 != qk_nope 32, 12 experts top-3, this
    vocabulary's ids."""
    cfg = preset_hf_config("kl-tiny")
    cfg["linear_attn_config"]["num_heads"] = kda_heads
    cfg.update(v_head_dim=40, qk_nope_head_dim=32, num_experts=12, num_experts_per_token=3,
               vocab_size=specials["num_base"] + NUM_SPECIAL_SLOTS, bos_token_id=specials["[BOS]"],
               eos_token_id=specials["[EOS]"], pad_token_id=specials["[PAD]"], initializer_range=0.1)
    return cfg


def write_hf_checkpoint(out: Path, chat_template: str | None = CHAT_TEMPLATE, seed: int = 0, *, kda_heads: int = 3,
                        released_spelling: bool = False, overrides: dict[str, Any] | None = None) -> Any:
    """save_pretrained of a bf16 KimiLinearForCausalLM (random init, seed `seed`) plus its own tokenizer.

    `released_spelling`: the dense layer's MLP renamed from transformers' `block_sparse_moe.*` to the released
    checkpoints' `mlp.*` (what llama.cpp's converter reads); `kda_heads` equal to the 4 MLA heads suits
    llama.cpp's Kimi graphs, which assume one head count for both; `overrides`: config.json keys replaced (a
    `linear_attn_config` dict is merged)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoModelForCausalLM, KimiLinearConfig

        out.mkdir(parents=True)
        specials = write_tokenizer(out, chat_template)
        torch.manual_seed(seed)
        values = hf_tiny_config(specials, kda_heads)
        for key, value in (overrides or {}).items():
            values[key] = {**values[key], **value} if key == "linear_attn_config" else value
        config = KimiLinearConfig(**values)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(out)
    if released_spelling:
        dense = [f"model.layers.{i}.block_sparse_moe." for i in range(config.first_k_dense_replace)]
        rename_tensors(out / "model.safetensors", {old: old.replace("block_sparse_moe.", "mlp.") for old in dense})
    return model


def rename_tensors(path: Path, prefixes: dict[str, str]) -> None:
    """Rewrite a safetensors file with every tensor name starting with a key of `prefixes` re-prefixed."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors = {}
    for name, tensor in load_file(str(path)).items():
        old = next((p for p in prefixes if name.startswith(p)), None)
        tensors[name if old is None else prefixes[old] + name[len(old):]] = tensor
    save_file(tensors, str(path), metadata=metadata)
