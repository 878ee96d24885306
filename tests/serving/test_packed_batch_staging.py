"""PackedBatch.build with a stage (the runner's prefill): one host->device copy for all of the pack's ints, and the
same pack as the per-field copies."""

from __future__ import annotations

import dataclasses

import torch

from k3verify.serving.batch import PackedBatch
from k3verify.serving.staging import HostStaging


def _fields(b: PackedBatch) -> dict[str, object]:
    return {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}


def test_staged_pack_equals_the_per_field_pack_in_one_copy() -> None:
    staging, calls = HostStaging(torch.device("cpu")), []

    def stage(values: list[int]) -> torch.Tensor:
        calls.append(len(values))
        return staging.to_device(values)

    ids = torch.arange(100, 112)
    kwargs = dict(start_pos=[0, 9, 3], slots=[2, 5, 1], page_tables=[[3], [4, 7], [1, 2]], page_size=8)
    plain = PackedBatch.build(ids, [5, 4, 3], **kwargs)  # type: ignore[arg-type]
    staged = PackedBatch.build(ids, [5, 4, 3], **kwargs, stage=stage)  # type: ignore[arg-type]
    assert calls == [12 + 4 + 3 + 3 + 3 * 2], calls  # ids, cu, starts, slots, the padded 3 x 2 page table
    for name, want in _fields(plain).items():
        got = _fields(staged)[name]
        assert (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want), name
    assert staged.page_table is not None and staged.page_table.shape == (3, 2)
    assert staged.page_table[1].tolist() == [4, 7] and staged.page_table[0].tolist() == [3, 0]


def test_staged_pack_without_caches() -> None:
    stage = HostStaging(torch.device("cpu")).to_device
    b = PackedBatch.build(torch.arange(7), [3, 4], stage=stage)
    assert b.slots is None and b.page_table is None
    assert b.cu_seqlens.tolist() == [0, 3, 7] and b.positions.tolist() == [0, 1, 2, 0, 1, 2, 3]


def test_runner_prefill_stages_its_pack(build_model) -> None:  # type: ignore[no-untyped-def]
    """The engine's prefill (ModelRunner.prefill) builds its pack through the runner's staging: one copy."""
    from k3verify.serving.runner import ModelRunner

    runner = ModelRunner(build_model("k3-tiny"), num_pages=16, page_size=8, num_slots=3, max_context=64)
    staged: list[int] = []
    to_device = runner.staging.to_device

    def counted(values: list[int]) -> torch.Tensor:
        staged.append(len(values))
        return to_device(values)

    runner.staging.to_device = counted  # type: ignore[method-assign]
    for sid in (1, 2):
        runner.admit(sid, 20)
    runner.prefill([(1, [5, 6, 7]), (2, [8, 9])])
    rows = [len(runner.kv_cache.table(sid)) for sid in (1, 2)]
    assert staged == [5 + 3 + 2 + 2 + 2 * max(rows)], (staged, rows)  # ids, cu, starts, slots, the padded table


def test_mla_context_rows_are_built_on_the_device_as_the_host_lists_gave_them() -> None:
    """serving/layers/mla.context_rows (keys of continuing sequences: cached prefix + new tokens) equals the
    host-list construction it replaced, for fresh and continuing sequences of different lengths."""
    from k3verify.presets import get_preset
    from k3verify.serving.kv_cache import PagedLatentCache
    from k3verify.serving.layers.mla import context_rows

    cache = PagedLatentCache(get_preset("kl-tiny"), num_pages=16, page_size=4, dtype=torch.float32,
                             device=torch.device("cpu"))
    starts, lens, tables = [5, 0, 9], [3, 2, 4], [[1, 2], [3], [4, 5, 6, 7]]
    b = PackedBatch.build(torch.arange(sum(lens)), lens, start_pos=starts, slots=[1, 2, 3], page_tables=tables,
                          page_size=4)
    assert b.page_table is not None
    keys = [s + n for s, n in zip(starts, lens, strict=True)]
    seq = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(keys)])
    pos = torch.cat([torch.arange(n) for n in keys])
    want = cache.rows(b.page_table, seq, pos)
    assert torch.equal(context_rows(b, cache, sum(keys)), want)
    assert want.tolist()[:8] == [4, 5, 6, 7, 8, 9, 10, 11]  # sequence 0: pages 1 and 2, positions 0..7
