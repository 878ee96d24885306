"""ensure_preset_checkpoint builds once per (preset, seed, code version), reuses, and rebuilds when damaged."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from k3verify.checkpoint import synthetic
from k3verify.checkpoint.synthetic import MARKER_FILE, ensure_preset_checkpoint

SHARD = "model-00001-of-00003.safetensors"


def test_cache_dir_name_carries_preset_seed_and_code_version(tmp_path: Path) -> None:
    path = ensure_preset_checkpoint("kl-tiny", seed=3, cache_dir=tmp_path)
    assert path.parent == tmp_path
    assert re.fullmatch(r"kl-tiny-s3-[0-9a-f]{12}", path.name)
    assert (path / MARKER_FILE).is_file() and (path / SHARD).is_file()


def test_second_call_reuses_the_cached_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = ensure_preset_checkpoint("kl-tiny", cache_dir=tmp_path)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt a complete cached checkpoint")

    monkeypatch.setattr(synthetic, "write_streamed_checkpoint", refuse)
    assert ensure_preset_checkpoint("kl-tiny", cache_dir=tmp_path) == first


def test_missing_marker_means_incomplete_and_is_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = ensure_preset_checkpoint("kl-tiny", cache_dir=tmp_path)
    (path / MARKER_FILE).unlink()
    (path / SHARD).unlink()
    with caplog.at_level(logging.WARNING, logger="k3verify.checkpoint.synthetic"):
        assert ensure_preset_checkpoint("kl-tiny", cache_dir=tmp_path) == path
    assert (path / SHARD).is_file() and (path / MARKER_FILE).is_file()
    assert "incomplete or stale; rebuilding" in caplog.text


def test_truncated_shard_under_a_valid_marker_is_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = ensure_preset_checkpoint("kl-tiny", cache_dir=tmp_path)
    good = (path / SHARD).read_bytes()
    (path / SHARD).write_bytes(good[:-7])
    with caplog.at_level(logging.WARNING, logger="k3verify.checkpoint.synthetic"):
        ensure_preset_checkpoint("kl-tiny", cache_dir=tmp_path)
    assert (path / SHARD).read_bytes() == good
    assert "is damaged" in caplog.text and SHARD in caplog.text


def test_env_var_sets_the_cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3V_CACHE_DIR", str(tmp_path / "env-root"))
    path = ensure_preset_checkpoint("kl-tiny")
    assert path.parent == tmp_path / "env-root" / "checkpoints"


def test_default_cache_root_is_under_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("K3V_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert synthetic.default_cache_root() == tmp_path / ".cache" / "k3verify" / "checkpoints"


def test_code_version_follows_the_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = tmp_path / "init.py"
    extra.write_text("a = 1\n")
    monkeypatch.setattr(synthetic, "_CODE_FILES", (*synthetic._CODE_FILES, str(extra)))
    before = synthetic.code_version()
    extra.write_text("a = 2\n")
    assert synthetic.code_version() != before


def test_tokenizer_assets_are_copied_byte_for_byte(tmp_path: Path) -> None:
    assets = synthetic._asset_files()
    if not assets:
        pytest.skip("k3verify/tokenizer/assets is empty (the tokenizer engineer has not built it yet)")
    path = ensure_preset_checkpoint("kl-tiny", cache_dir=tmp_path)
    for asset in assets:
        assert (path / asset.name).read_bytes() == asset.read_bytes()


def test_missing_tokenizer_assets_warn_and_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    empty = tmp_path / "assets"
    empty.mkdir()
    monkeypatch.setattr(synthetic, "TOKENIZER_ASSETS", empty)
    with caplog.at_level(logging.WARNING, logger="k3verify.checkpoint.synthetic"):
        written = synthetic.make_synthetic_checkpoint("kl-tiny", tmp_path / "out")
    assert "has no tokenizer assets yet" in caplog.text
    assert not (written.path / "tiktoken.model").exists()


def test_real_shapes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="real shape"):
        ensure_preset_checkpoint("k3", cache_dir=tmp_path)
