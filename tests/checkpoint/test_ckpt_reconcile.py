"""Reconcile sorts every fault into its bucket, exits non-zero on any, and works at the real K3 shape."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from k3verify.checkpoint.buckets import (
    ExpectedTensor,
    PartialSlot,
    ReconcileResult,
    build_param_module,
    expected_from_module,
    reconcile_checkpoint,
)
from k3verify.checkpoint.names import module_specs
from k3verify.cli import main
from k3verify.config import ModelConfig

P = "language_model."
O_PROJ = f"{P}model.layers.0.self_attn.o_proj.weight"  # KDA o_proj [hidden 96, heads*dim 48]
EXPERT = f"{P}model.layers.1.block_sparse_moe.experts.3.w1"


def assert_reconciles_clean(ckpt: Path, *, index_only: bool = False) -> ReconcileResult:
    """The reconciler's green check: all four buckets empty."""
    result = reconcile_checkpoint(ckpt, index_only=index_only)
    assert result.ok, {k: v[:3] for k, v in result.buckets().items() if v}
    return result


def _cli(ckpt: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    rc = main(["checkpoint", "reconcile", str(ckpt), *extra])
    return rc, capsys.readouterr().out


def test_clean_checkpoint_reconciles_with_all_buckets_empty(k3_tiny_dir: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    result = assert_reconciles_clean(k3_tiny_dir)
    assert result.num_matched == result.num_expected == 396
    assert sorted(u.name for u in result.ignored) == [
        "mm_projector.proj.0.weight", "vision_tower.encoder.final_layernorm.weight",
        "vision_tower.patch_embed.proj.weight"]
    assert all("text-only serving" in u.reason for u in result.ignored)
    rc, out = _cli(k3_tiny_dir, capsys)
    assert rc == 0
    assert "expected 396, found 396, missing 0" in out and "result: OK" in out


def test_dropped_tensor_lands_in_bucket_a(variant, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = variant("dropped", lambda t: t.pop(O_PROJ))
    result = reconcile_checkpoint(ckpt)
    assert result.no_source == [O_PROJ.removeprefix(P)]
    assert not (result.partial or result.no_destination or result.mismatched)
    rc, out = _cli(ckpt, capsys)
    assert rc == 1 and "(a) parameter without a source       1" in out


def test_partial_quantized_pair_lands_in_bucket_b(variant, capsys: pytest.CaptureFixture[str]) -> None:
    """weight_packed without weight_scale is one partial slot, not a missing plus an unexpected tensor."""
    ckpt = variant("partial", lambda t: t.pop(f"{EXPERT}.weight_scale"))
    result = reconcile_checkpoint(ckpt)
    assert result.partial == [PartialSlot(EXPERT.removeprefix(P), f"{EXPERT}.weight_packed", f"{EXPERT}.weight_scale")]
    assert not (result.no_source or result.no_destination or result.mismatched)
    rc, out = _cli(ckpt, capsys)
    assert rc == 1 and f"lacks {EXPERT}.weight_scale" in out


def test_partial_pair_into_a_dense_expert_module_lands_in_bucket_b(variant) -> None:
    """Same fault seen by an oracle holding dense wN.weight (filled by dequantizing the pair)."""
    ckpt = variant("partial-dense", lambda t: t.pop(f"{EXPERT}.weight_packed"))
    cfg = ModelConfig.from_file(ckpt)
    expected = []
    for name, spec in module_specs(cfg).items():
        if name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            expected.append(ExpectedTensor(name.removesuffix("_packed"), (spec.shape[0], spec.shape[1] * 2), None))
        else:
            expected.append(ExpectedTensor(name, spec.shape, spec.dtype))
    result = reconcile_checkpoint(ckpt, expected=expected)
    assert result.partial == [PartialSlot(EXPERT.removeprefix(P), f"{EXPERT}.weight_scale", f"{EXPERT}.weight_packed")]
    assert not (result.no_source or result.no_destination or result.mismatched)
    assert result.num_matched == len(expected) - 1


def test_extra_tensors_land_in_bucket_c_and_ignorables_apart(variant, capsys: pytest.CaptureFixture[str]) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t[f"{P}model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
        t["unprefixed.weight"] = torch.zeros(2)
        t["vision_tower.extra.weight"] = torch.zeros(2)

    result = reconcile_checkpoint(variant("extra", add))
    assert [u.name for u in result.no_destination] == [f"{P}model.layers.0.self_attn.bogus.weight",
                                                       "unprefixed.weight"]
    assert "lacks the 'language_model.' prefix" in result.no_destination[1].reason
    assert "vision_tower.extra.weight" in {u.name for u in result.ignored}
    assert not (result.no_source or result.partial or result.mismatched)


def test_transposed_o_proj_lands_in_bucket_d_as_shape(variant, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = variant("transposed", lambda t: t.__setitem__(O_PROJ, t[O_PROJ].T.contiguous()))
    result = reconcile_checkpoint(ckpt)
    [bad] = result.mismatched
    assert (bad.checkpoint_name, bad.kind, bad.found_shape, bad.expected_shape) == (O_PROJ, "shape", (48, 96), (96, 48))
    assert not (result.no_source or result.partial or result.no_destination)
    rc, out = _cli(ckpt, capsys)
    assert rc == 1 and "(d) shape/dtype mismatch             1" in out


def test_wrong_dtype_lands_in_bucket_d_as_dtype(variant) -> None:
    name = f"{P}model.norm.weight"
    result = reconcile_checkpoint(variant("dtype", lambda t: t.__setitem__(name, t[name].float())))
    [bad] = result.mismatched
    assert (bad.checkpoint_name, bad.kind) == (name, "dtype")
    assert (bad.found_dtype, bad.expected_dtype) == ("float32", "bfloat16")


def test_index_only_mode_cannot_see_a_transposed_tensor(variant, capsys: pytest.CaptureFixture[str]) -> None:
    """Documented limitation: the index has names only, so a transposed tensor passes index-only mode."""
    ckpt = variant("transposed", lambda t: t.__setitem__(O_PROJ, t[O_PROJ].T.contiguous()))
    assert reconcile_checkpoint(ckpt, index_only=True).ok
    assert not reconcile_checkpoint(ckpt).ok
    rc, out = _cli(ckpt, capsys, "--index-only")
    assert rc == 0 and "index-only mode sees names only" in out


def test_index_only_mode_still_sees_names(variant) -> None:
    result = reconcile_checkpoint(variant("dropped", lambda t: t.pop(O_PROJ)), index_only=True)
    assert result.no_source == [O_PROJ.removeprefix(P)] and result.mode == "index-only"


def test_transposing_a_tensor_turns_the_reconciler_check_red(variant, k3_tiny_dir: Path) -> None:
    """The detector bites: the green check above fails once the fixture is flipped."""
    assert_reconciles_clean(k3_tiny_dir)
    flipped = variant("flipped", lambda t: t.__setitem__(O_PROJ, t[O_PROJ].T.contiguous()))
    with pytest.raises(AssertionError, match="d_mismatched"):
        assert_reconciles_clean(flipped)


def test_json_output_carries_every_bucket(variant, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _cli(variant("dropped", lambda t: t.pop(O_PROJ)), capsys, "--json")
    data = json.loads(out)
    assert rc == 1 and data["ok"] is False
    assert data["counts"] == {"a_no_source": 1, "b_partial": 0, "c_no_destination": 0, "d_mismatched": 0,
                              "ignored": 3, "tolerated": 0}


def test_expected_tensors_can_come_from_a_meta_module(k3_tiny_dir: Path) -> None:
    """A serving model's meta-device parameters can stand in for module_specs; a missing one shows up in (c)."""
    cfg = ModelConfig.from_file(k3_tiny_dir)
    specs = module_specs(cfg)
    del specs["model.norm.weight"]
    result = reconcile_checkpoint(k3_tiny_dir, expected=expected_from_module(build_param_module(specs)))
    assert [u.name for u in result.no_destination] == [f"{P}model.norm.weight"]


@pytest.fixture(scope="module")
def k3_real_sparse(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The real K3 shape (~500k tensors, 1.4 TiB declared) as exact headers over sparse, all-zero data."""
    out = tmp_path_factory.mktemp("k3real") / "k3"
    assert main(["checkpoint", "make", "--preset", "k3", "--sparse", str(out)]) == 0
    yield out
    shutil.rmtree(out)  # ~140 MB of real blocks (index + headers); don't leave it to pytest's retention


def test_real_k3_shape_reconciles_through_shard_headers(k3_real_sparse: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    shard = next(k3_real_sparse.glob("model-*.safetensors"))
    assert shard.stat().st_blocks * 512 < 64 << 20, "sparse shard occupies real disk blocks"
    rc, out = _cli(k3_real_sparse, capsys)
    assert rc == 0, out
    assert "checkpoint tensors 497055, expected 497052, found 497052, missing 0" in out
