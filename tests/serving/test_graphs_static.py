"""The graph-decode step without a graph (CPU): it equals ServingModel.decode bit-exactly at equal
shapes, parks padded rows on scratch, and its capture signature sees a relocated cache slice."""

from __future__ import annotations

import pytest
import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.batch import SCRATCH
from k3verify.serving.graphs import GraphDecoder, StaticInputs, capture_signature, static_decode
from k3verify.serving.runner import ModelRunner, build_runner

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [100, 200, 300, 400, 500, 600, 700], [1, 2, 3, 4, 5, 6, 7]]


def _prefilled(preset: str) -> tuple[ModelRunner, list[int]]:
    cfg = get_preset(preset)
    runner = build_runner(cfg, synthetic_tensors(cfg), dtype=torch.float32, num_pages=64, page_size=8, num_slots=6,
                          max_context=128)
    for i, p in enumerate(PROMPTS):
        runner.admit(i, len(p) + 6)
    return runner, runner.prefill([(i, p) for i, p in enumerate(PROMPTS)]).argmax(-1).tolist()


def _args(runner: ModelRunner) -> tuple[list[int], list[list[int]], list[int]]:
    seqs = [runner._get(i) for i in range(len(PROMPTS))]
    return [s.slot for s in seqs], [runner.kv_cache.table(i) for i in range(len(PROMPTS))], [s.cached for s in seqs]


@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny"])
def test_static_step_equals_model_decode_bitexact(preset: str) -> None:
    """Same shapes (bucket = batch, context = longest), same kernels: the static step is ServingModel.decode."""
    runner, toks = _prefilled(preset)
    slots, tables, pos = _args(runner)
    pool, kv = runner.state_pool.tensors(), runner.kv_cache.data
    snap = ({k: v.clone() for k, v in pool.items()}, kv.clone())
    eager = runner.model.decode(torch.tensor(toks), slots, tables, pos)
    eager_state = {k: v.clone() for k, v in pool.items()}
    for k, v in snap[0].items():
        pool[k].copy_(v)
    kv.copy_(snap[1])
    inputs = StaticInputs.allocate(len(PROMPTS), 2, runner.model.device)
    inputs.fill(toks, slots, tables, pos)
    static = static_decode(runner.model, inputs, max(pos) + 1)
    assert torch.equal(eager, static)
    live = [s for s in slots]
    for k in pool:
        assert torch.equal(pool[k][:, live], eager_state[k][:, live]), k


def test_padded_rows_park_on_scratch_and_live_rows_match_unpadded() -> None:
    """A bucket of 8 for 4 sequences: rows 4..7 read/write only the scratch slot/page, and the live
    rows agree with the unpadded step to fp32 rounding (GEMM shapes differ, so not bit-exact)."""
    runner, toks = _prefilled("k3-tiny")
    slots, tables, pos = _args(runner)
    pool = runner.state_pool.tensors()
    other = [s for s in range(runner.state_pool.num_slots) if s not in slots and s != SCRATCH]
    before = {k: v[:, other].clone() for k, v in pool.items()}
    snap = ({k: v.clone() for k, v in pool.items()}, runner.kv_cache.data.clone())
    ref = runner.model.decode(torch.tensor(toks), slots, tables, pos)
    for k, v in snap[0].items():
        pool[k].copy_(v)
    runner.kv_cache.data.copy_(snap[1])
    dec = GraphDecoder(runner.model, 128, buckets=(8,), use_graphs=False)
    out = dec.decode(toks, slots, tables, pos)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    inputs = dec._inputs[8]
    assert inputs.slots[4:].eq(SCRATCH).all() and inputs.page_table[4:].eq(SCRATCH).all()
    for k, v in pool.items():
        assert torch.equal(v[:, other], before[k]), f"{k}: an unused slot changed"


def test_signature_catches_a_shrunk_cache_even_at_the_same_address() -> None:
    """Re-allocating the latent cache with fewer pages moves every layer slice above layer 0: the
    signature must differ even when the allocator hands back the same base pointer."""
    runner, _ = _prefilled("k3-tiny")
    model = runner.model
    sig = capture_signature(model)
    data = model.kv_cache.data
    shrunk = data.view(-1)[: data.numel() // 2].view(data.shape[0], data.shape[1] // 2, *data.shape[2:])
    assert shrunk.data_ptr() == data.data_ptr()
    model.kv_cache.data = shrunk
    try:
        assert capture_signature(model) != sig
        pointers_only = [(n, p) for n, p, *_ in capture_signature(model)]
        assert pointers_only == [(n, p) for n, p, *_ in sig], "control: addresses alone cannot see the move"
    finally:
        model.kv_cache.data = data


def test_bucket_selection_and_overflow() -> None:
    runner, _ = _prefilled("kl-tiny")
    dec = GraphDecoder(runner.model, 128, buckets=(1, 2, 4), use_graphs=False)
    assert [dec.bucket_for(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(ValueError, match="exceeds the largest captured bucket 4"):
        dec.bucket_for(5)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        GraphDecoder(runner.model, 128, use_graphs=True)


def test_replay_vs_eager_helper_runs_the_same_step_twice() -> None:
    """Without graphs both sides are the eager static step: equal, caches restored between them, and the
    sequences released afterwards (the helper the CUDA check and the bench share)."""
    from k3verify.gates.shared.replay import replay_vs_eager

    runner, _ = _prefilled("k3-tiny")
    for i in range(len(PROMPTS)):
        runner.release(i)
    dec = GraphDecoder(runner.model, 128, buckets=(4,), use_graphs=False)
    ref, cand, ctrl = replay_vs_eager(runner, dec, [[3, 4, 5], [9, 8, 7, 6]], steps=4)
    assert ref.shape == cand.shape == (4, 2, runner.model.cfg.vocab_size)
    assert torch.equal(ref, cand) and ctrl is None
    assert runner.active_ids == []
    runner.check_integrity()
