"""Run llama.cpp's own converter (`convert_hf_to_gguf.py` of a llama.cpp source tree) on a Kimi checkpoint, with
one step replaced: the vocabulary.

llama.cpp's Kimi converters build the vocabulary through the model repository's remote tokenizer code
(`AutoTokenizer(trust_remote_code=True)`), which a checkpoint of this project does not ship. Everything else, every
tensor and every other metadata key, is the converter's own work: that independence is what makes llama.cpp a
second implementation worth comparing against. `--vocab none` writes no vocabulary at all, so a test can show that
the hook changes nothing but `tokenizer.*` keys.

Run as `python -m k3verify.peers.llamacpp_convert --tree DIR [--vocab checkpoint|none] -- CONVERTER ARGS...`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from k3verify.peers.gguf_vocab import PRE_TOKENIZER, TOKENIZER_MODEL, gguf_vocab
from k3verify.tokenizer import KimiTokenizer


def checkpoint_vocab(model: Any) -> None:
    """The replacement for the converter's Kimi `set_vocab`: the checkpoint's tiktoken files as a GGUF
    vocabulary, then the converter's own special-token and chat-template reading (gguf-py's SpecialVocab), and
    eos forced to the tokenizer's own, as the converter does."""
    import gguf  # the tree's gguf-py, put on sys.path by main()

    tokenizer = KimiTokenizer.from_dir(Path(model.dir_model))
    vocab = gguf_vocab(tokenizer, int(model.hparams["vocab_size"]))
    writer = model.gguf_writer
    writer.add_tokenizer_model(TOKENIZER_MODEL)
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    gguf.SpecialVocab(model.dir_model, load_merges=False).add_to_gguf(writer)
    writer.add_eos_token_id(tokenizer.eos_id)


def no_vocab(model: Any) -> None:
    """Writes nothing: the baseline a hooked conversion is compared with."""


HOOKS = {"checkpoint": checkpoint_vocab, "none": no_vocab}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m k3verify.peers.llamacpp_convert", description=__doc__)
    parser.add_argument("--tree", type=Path, required=True, help="llama.cpp source tree (holds convert_hf_to_gguf.py)")
    parser.add_argument("--vocab", choices=sorted(HOOKS), default="checkpoint")
    parser.add_argument("converter_args", nargs=argparse.REMAINDER, help="after --: the converter's own arguments")
    args = parser.parse_args(argv)
    tree = args.tree.resolve()
    script = tree / "convert_hf_to_gguf.py"
    if not script.is_file():
        parser.error(f"--tree {tree}: no convert_hf_to_gguf.py there")
    rest = args.converter_args[1:] if args.converter_args[:1] == ["--"] else args.converter_args
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]
    import convert_hf_to_gguf  # noqa: I001  (the tree's converter, importable only now)
    from conversion.kimi_linear import KimiLinearModel  # K3's converter borrows this class's set_vocab

    KimiLinearModel.set_vocab = HOOKS[args.vocab]
    sys.argv = [str(script), *rest]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
