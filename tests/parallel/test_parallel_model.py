"""The parallel serving model on one process: layouts, the world-1 model equal to the single-process one bit for
bit, rank shapes from the meta device, slice loading that reads only a rank's bytes, and the slice reconcile."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3verify.checkpoint.reader import CheckpointError, CheckpointReader
from k3verify.config import ModelConfig
from k3verify.presets import get_preset
from k3verify.serving.batch import PackedBatch
from k3verify.serving.layers.kda import KimiDeltaAttention
from k3verify.serving.layers.mla import MultiHeadLatentAttention
from k3verify.serving.layers.mlp import GatedMLP
from k3verify.serving.model import ServingModel
from k3verify.serving.parallel import Comm, LayoutError, ParallelLayout, ParallelServingModel, check_layout
from k3verify.serving.parallel.layers import RowParallelLinear
from k3verify.serving.parallel.layout import split_range
from k3verify.serving.parallel.shards import load_rank, read_spec
from k3verify.serving.parallel.slice_reconcile import rank_shapes, reconcile_slices
from k3verify.target import resolve_target


def test_split_range_tiles_uneven_counts() -> None:
    """Near-equal contiguous ranges that tile n exactly, larger ones first."""
    assert [split_range(3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    assert [split_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(LayoutError, match="part 2 of 2"):
        split_range(4, 2, 2)


@pytest.mark.parametrize(("tp", "ep", "match"), [(2, 4, "each degree must be 1 or the world size 4"),
                                                  (0, 1, "--tp must be >= 1"), (3, 1, None)])
def test_layout_degrees_are_one_or_the_world(tp: int, ep: int, match: str | None) -> None:
    if match is None:
        assert ParallelLayout(tp, ep).world == 3
        return
    with pytest.raises(LayoutError, match=match):
        ParallelLayout(tp, ep)


def test_layout_refuses_a_rank_without_heads() -> None:
    """k3-tiny has 3 KDA heads: world 2 splits them 2 + 1, world 4 is refused naming the count."""
    cfg = get_preset("k3-tiny")
    check_layout(cfg, ParallelLayout(2, 2))
    with pytest.raises(LayoutError, match=r"KDA heads\) = 3 cannot be split over 4 ranks"):
        check_layout(cfg, ParallelLayout(4, 1))
    check_layout(get_preset("k3-tp4"), ParallelLayout(4, 4))


@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny"])
def test_world_of_one_equals_the_single_process_model(preset: str) -> None:
    """tp = ep = 1: the parallel model is built on meta, materialized and loaded through the slice loader, and
    computes the single-process model's logits bit for bit, with the same parameter names."""
    target = resolve_target(preset)
    with target.weights() as reader:
        single = ServingModel(target.cfg, torch.float32).load(reader)
        par = ParallelServingModel(target.cfg, Comm(ParallelLayout(1, 1)), torch.float32).load(reader)
    assert list(single.state_dict()) == list(par.state_dict())
    ids = torch.randint(0, target.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    batch = PackedBatch.build(ids, [15, 25])
    a = single.prefill(batch, all_logits=True).all_logits
    b = par.prefill(batch, all_logits=True).all_logits
    assert a is not None and b is not None and torch.equal(a, b)


def test_parallel_model_keeps_the_single_process_attributes() -> None:
    """ParallelServingModel builds its own tree (ServingModel.__init__ would build the unsplit model): it must
    still carry every plain attribute ServingModel sets, or a forward written against ServingModel breaks."""
    cfg = get_preset("k3-tiny")
    single = ServingModel(cfg, torch.float32, "meta")
    par = ParallelServingModel(cfg, Comm(ParallelLayout(1, 1)), torch.float32, "meta")
    missing = set(vars(single)) - set(vars(par))
    assert not missing, f"ParallelServingModel lacks ServingModel attributes {sorted(missing)}"
    for a, b in zip(single.model.layers, par.model.layers, strict=True):
        assert set(vars(a)) - {"_modules"} <= set(vars(b)), "ParallelDecoderLayer lacks DecoderLayer attributes"


def test_rank_shapes_split_heads_experts_and_vocab() -> None:
    """k3-tiny at tp = ep = 2: rank 0 holds 2 of 3 KDA heads, rank 1 one; 4 of 8 experts each; half the vocab."""
    cfg = get_preset("k3-tiny")
    s0, s1 = (rank_shapes(cfg, ParallelLayout(2, 2, r)) for r in range(2))
    q = "model.layers.1.self_attn.q_proj.weight"
    assert s0[q] == (2 * 16, cfg.hidden_size) and s1[q] == (16, cfg.hidden_size)
    assert s0["model.layers.1.self_attn.A_log"] == (2,) and s1["model.layers.1.self_attn.A_log"] == (1,)
    experts = {n.split(".")[5] for n in s1 if ".experts." in n and n.startswith("model.layers.1.")}
    assert experts == {"0", "1", "2", "3"}
    assert s0["lm_head.weight"] == (cfg.vocab_size // 2, cfg.hidden_size)


class CountingReader(CheckpointReader):
    """A reader that counts the tensor bytes it hands out."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.bytes_read = 0

    def get(self, name, default=None):  # type: ignore[no-untyped-def]
        t = super().get(name)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        t = super().get_slice(name, dim, start, stop)
        self.bytes_read += t.numel() * t.element_size()
        return t


def test_a_rank_reads_only_its_slices() -> None:
    """Each rank of kl-tiny at tp = ep = 2 reads well under the whole checkpoint, and the ranks together read
    every byte at least once (replicated tensors once per rank)."""
    target = resolve_target("kl-tiny")
    reads = []
    for rank in range(2):
        reader = CountingReader(target.checkpoint_dir)
        model = ParallelServingModel(target.cfg, Comm(ParallelLayout(2, 2, rank), planning=True), torch.float32)
        load_rank(model, target.cfg, model.layout, reader)
        reads.append(reader.bytes_read)
    total = CheckpointReader(target.checkpoint_dir).total_data_bytes
    assert all(r < 0.6 * total for r in reads), (reads, total)
    assert sum(reads) >= total


def test_get_slice_reads_the_rows_and_refuses_outside() -> None:
    target = resolve_target("kl-tiny")
    reader = target.weights()
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(reader.get_slice(name, 1, 8, 24), reader[name][:, 8:24])
    with pytest.raises(CheckpointError, match=r"has no slice \[60, 70\) along dim 1"):
        reader.get_slice(name, 1, 60, 70)


def _stored(cfg: ModelConfig, preset: str) -> dict[str, tuple[int, ...]]:
    return {n: e.shape for n, e in resolve_target(preset).weights().entries.items()}


@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny", "k3-skew-10"])
def test_slice_reconcile_is_clean_on_the_presets(preset: str) -> None:
    cfg = get_preset(preset)
    for layout in ((2, 2), (2, 1), (1, 2)):
        assert reconcile_slices(cfg, ParallelLayout(*layout), _stored(cfg, preset)) == []


def test_slice_reconcile_names_a_transposed_tensor() -> None:
    """A tensor stored transposed is named, per rank, with both shapes; a missing one too."""
    cfg = get_preset("kl-tiny")
    stored = _stored(cfg, "kl-tiny")
    name = "model.layers.1.self_attn.o_proj.weight"
    stored[name] = tuple(reversed(stored[name]))
    del stored["model.layers.2.self_attn.b_proj.weight"]
    problems = reconcile_slices(cfg, ParallelLayout(2, 2), stored)
    assert any(f"rank 1: parameter {name}" in p and "is stored transposed: stored [32, 64]" in p for p in problems)
    assert any("model.layers.2.self_attn.b_proj.weight" in p and "no such tensor" in p for p in problems)


def test_a_mis_sliced_load_raises_naming_the_rank() -> None:
    """A slice whose shape is not the parameter's raises with the rank, the slice and both shapes."""
    target = resolve_target("kl-tiny")
    model = ParallelServingModel(target.cfg, Comm(ParallelLayout(2, 2, 1), planning=True), torch.float32)

    def one_row_short(tensors, spec):  # type: ignore[no-untyped-def]
        t = read_spec(tensors, spec)
        return t.narrow(spec.dim, 0, t.shape[spec.dim] - 1) if spec.dim is not None else t

    with pytest.raises(ValueError, match=r"rank 1 \(tp=2 ep=2 \(world 2\)\): .*\[.* along dim .*\] has shape"):
        load_rank(model, target.cfg, model.layout, target.weights(), read=one_row_short)


@pytest.mark.parametrize(("preset", "mode"), [("k3-tiny", "cached"), ("k3-tiny", "packed"), ("kl-tiny", "cached")])
def test_expert_dispatch_of_one_rank_equals_the_moe_block(preset: str, mode: str) -> None:
    """ParallelMoE on a world of one (every expert local, no collective): selecting each (token, expert) pair,
    combining it alone and adding the pairs back per token gives SparseMoE's output bit for bit, with
    dequantized and with packed MXFP4 experts."""
    from k3verify.serving.parallel.moe import ParallelMoE

    target = resolve_target(preset)
    single = ServingModel(target.cfg, torch.float32, mxfp4_mode=mode).load(target.weights())
    moe = single.model.layers[1].block_sparse_moe
    par = ParallelMoE(target.cfg, torch.float32, "cpu", mode, None, Comm(ParallelLayout(1, 1)))
    par.load_state_dict(moe.state_dict())
    x = torch.randn(37, target.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    assert torch.equal(par(x), moe(x))
    assert par.rows_routed == 37 * target.cfg.num_experts_per_token


def test_a_tensor_parallel_rank_is_built_from_the_plain_layers() -> None:
    """k3-tiny at tp = 2: every attention and dense MLP is the plain layer class whose output projection is a
    RowParallelLinear (the one collective); at tp = 1 (control) the same model holds plain nn.Linear there."""
    cfg = get_preset("k3-tiny")
    for tp, want in ((2, RowParallelLinear), (1, torch.nn.Linear)):
        model = ParallelServingModel(cfg, Comm(ParallelLayout(tp, 1), planning=True), torch.float32, "meta")
        for layer in model.model.decoder_layers():
            assert type(layer.self_attn) in (KimiDeltaAttention, MultiHeadLatentAttention)
            assert type(layer.self_attn.o_proj) is want, (tp, layer.layer_idx)
            if not layer.is_moe:
                assert type(layer.mlp) is GatedMLP and type(layer.mlp.down_proj) is want
