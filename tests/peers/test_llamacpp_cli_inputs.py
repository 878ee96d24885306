"""`llamacpp` commands on bad input, with a stand-in llama.cpp installation (no build needed): a converter that
fails mid-write leaves no partial GGUF behind, and an unbalanced --server-args is a usage error, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3verify.cli import main
from k3verify.peers.llamacpp import LlamaCpp, LlamaCppError

CONVERTER = '''import sys
def main():
    out = sys.argv[sys.argv.index("--outfile") + 1]
    with open(out, "wb") as fh:
        fh.write(b"GGUF" + b"\\0" * 64)  # the header and part of the tensors, as a converter writes them
        if {fail}:
            raise SystemExit("safetensors_rust.SafetensorError: incomplete metadata, file not fully covered")
'''


def fake_install(root: Path, *, fail: bool) -> LlamaCpp:
    """root/llama.cpp with a converter that writes part of a GGUF and then fails (or finishes), and an executable
    root/build/bin/llama-server that is never run."""
    tree = root / "llama.cpp"
    (tree / "conversion").mkdir(parents=True)
    (tree / "gguf-py").mkdir()
    (tree / "convert_hf_to_gguf.py").write_text(CONVERTER.format(fail=fail))
    (tree / "conversion" / "__init__.py").write_text("")
    (tree / "conversion" / "kimi_linear.py").write_text("class KimiLinearModel:\n    pass\n")
    server = root / "build" / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.write_text("#!/bin/sh\nexit 1\n")
    server.chmod(0o755)
    return LlamaCpp.at(root)


@pytest.mark.parametrize("previous", [False, True], ids=["no earlier file", "an earlier GGUF"])
def test_a_failed_conversion_leaves_no_partial_gguf(tmp_path: Path, previous: bool) -> None:
    """The converter dies after writing 68 bytes: convert raises naming the failure, `out` is as it was (absent,
    or the earlier GGUF untouched) and no temporary file is left in its directory."""
    peer = fake_install(tmp_path / "install", fail=True)
    out = tmp_path / "out" / "model.gguf"
    out.parent.mkdir()
    if previous:
        out.write_bytes(b"an earlier, complete GGUF")
    with pytest.raises(LlamaCppError, match=r"(?s)converter failed .* nothing was written to .*incomplete metadata"):
        peer.convert(tmp_path / "ckpt", out)
    assert (out.read_bytes() == b"an earlier, complete GGUF") if previous else not out.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == (["model.gguf"] if previous else [])


def test_a_finished_conversion_is_renamed_into_place(tmp_path: Path) -> None:
    """The control: the same converter finishing gives `out` its bytes and leaves nothing else."""
    peer = fake_install(tmp_path / "install", fail=False)
    out = tmp_path / "out" / "model.gguf"
    out.parent.mkdir()
    assert peer.convert(tmp_path / "ckpt", out) == out and out.read_bytes().startswith(b"GGUF")
    assert [p.name for p in out.parent.iterdir()] == ["model.gguf"]


def test_unbalanced_server_args_are_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--server-args with an unclosed quote: exit 2 naming the value and the reason, no ValueError traceback."""
    fake_install(tmp_path / "install", fail=False)
    code = main(["llamacpp", "serve", str(tmp_path / "m.gguf"), "--llamacpp", str(tmp_path / "install"),
                 '--server-args=--alias "unbalanced'])
    err = capsys.readouterr().err
    assert code == 2 and "--server-args '--alias \"unbalanced': No closing quotation" in err, err
