"""CUDA-graph prefill without a graph (CPU): the bucket policy, the buffers' padding, the static step against the
eager prefill, the host-offset guard, and the engine with prefill graphs on. Capture and replay: tests/serving/
test_prefill_graphs_cuda.py and the gate checks serving.prefill_graph.* (CUDA)."""

from __future__ import annotations

import pytest
import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.batch import SCRATCH, DeviceOnly
from k3verify.serving.prefill_graphs import (
    MAX_PADDED_RATIO,
    GraphPrefill,
    PrefillInputs,
    PrefillShape,
    filler_lens,
    prefill_shape,
    static_batch,
)
from k3verify.serving.runner import ModelRunner, build_runner, generate_greedy

EXACT = [list(range(10, 74)), list(range(60, 124)), list(range(100, 164)), list(range(7, 71))]  # 4 x 64: no filler


def _runner(preset: str = "k3-tiny") -> ModelRunner:
    cfg = get_preset(preset)
    return build_runner(cfg, synthetic_tensors(cfg), dtype=torch.float32, num_pages=64, page_size=8, num_slots=8,
                        max_context=256)


def _graphs(runner: ModelRunner) -> GraphPrefill:
    return GraphPrefill(runner.model, max_tokens=512, max_seqs=16, use_graphs=False, capture_after=1)


def _prefill(runner: ModelRunner, prompts: list[list[int]], graphs: GraphPrefill | None
             ) -> tuple[list[int], torch.Tensor]:
    first = max(runner.active_ids, default=-1) + 1
    ids = list(range(first, first + len(prompts)))
    for sid, p in zip(ids, prompts, strict=True):
        runner.admit(sid, len(p) + 4)
    return ids, runner.prefill(list(zip(ids, prompts, strict=True)), graphs)


def _live(runner: ModelRunner, ids: list[int]) -> dict[str, torch.Tensor]:
    slots = [runner.slot_of(s) for s in ids]
    pages = [p for s in ids for p in runner.kv_cache.table(s)]
    out = {k: v[:, slots].clone() for k, v in runner.state_pool.tensors().items()}
    out["latents"] = runner.kv_cache.data[:, pages].clone()
    return out


def test_buckets() -> None:
    assert prefill_shape([1024], max_tokens=8192, max_seqs=128) == PrefillShape(1024, 1, 1024)
    assert prefill_shape([128] * 64, max_tokens=8192, max_seqs=128) == PrefillShape(8192, 64, 128)
    # 1000 tokens: a filler of 24 makes 1024, so two sequences
    assert prefill_shape([1000], max_tokens=8192, max_seqs=128) == PrefillShape(1024, 2, 1024)
    assert prefill_shape([10], max_tokens=8192, max_seqs=128) == PrefillShape(64, 2, 64)  # bounds: at least a chunk
    assert prefill_shape([4100], max_tokens=8192, max_seqs=128) == PrefillShape(5120, 2, 5120)  # not 8192
    # 37 prompts of 128 (4736 tokens) pad to 5120 (an eighth of 8192 at a time), not to 8192
    assert prefill_shape([128] * 37, max_tokens=8192, max_seqs=128) == PrefillShape(5120, 64, 128)
    # one long prompt among short ones would pad the attention to 64 x 1024 rows: eager
    assert prefill_shape([1000] + [10] * 60, max_tokens=8192, max_seqs=128) is None
    assert prefill_shape([4096], max_tokens=2048, max_seqs=128) is None
    assert prefill_shape([64] * 40, max_tokens=8192, max_seqs=32) is None
    with pytest.raises(ValueError, match="at least one token"):
        prefill_shape([5, 0], max_tokens=8192, max_seqs=128)


@pytest.mark.parametrize("lens", [[1000], [50, 40], [30, 50, 20], [128] * 37, [700, 300, 20], [4100], [65] * 3])
def test_bucket_fits_its_pack(lens: list[int]) -> None:
    """Every pack fits its bucket: fillers no longer than L make up T, and live + fillers fit B; the padded attention
    stays within its bound."""
    shape = prefill_shape(lens, max_tokens=1 << 14, max_seqs=256)
    assert shape is not None
    fill = filler_lens(shape, lens)
    assert sum(lens) + sum(fill) == shape.num_tokens and all(0 < f <= shape.max_len for f in fill)
    assert len(lens) + len(fill) <= shape.num_seqs and max(lens) <= shape.max_len
    assert shape.padded_rows <= MAX_PADDED_RATIO * shape.num_tokens
    # padding: less than a quarter more, or less than one L (T a multiple of L) / one chunk (L)
    assert shape.num_tokens - sum(lens) < max(shape.max_len, sum(lens) // 4 + 1)
    assert shape.max_len - max(lens) < max(64, max(lens) // 4 + 1)
    assert len(filler_lens(shape, [])) <= shape.num_seqs  # the capture's all-filler pack fits too


def test_buffer_values_pad_on_scratch() -> None:
    inputs = PrefillInputs(PrefillShape(128, 4, 64), page_size=16, device=torch.device("cpu"))
    vals = inputs.values(list(range(90)), [50, 40], [3, 5], [[7, 8, 9, 10], [11, 12, 13]])
    ids, cu, slots, table = torch.tensor(vals).split([128, 5, 4, 16])
    assert ids[:90].tolist() == list(range(90)) and ids[90:].eq(0).all()
    assert cu.tolist() == [0, 50, 90, 128, 128]  # a filler of 38 tokens, then an empty sequence at the end
    assert slots.tolist() == [3, 5, SCRATCH, SCRATCH]
    # a live sequence of at most 64 tokens reads only its first 4 pages; fillers read the scratch page only
    assert table.view(4, 4).tolist() == [[7, 8, 9, 10], [11, 12, 13, SCRATCH], [SCRATCH] * 4, [SCRATCH] * 4]
    with pytest.raises(ValueError, match="do not fit the bucket"):
        inputs.values(list(range(65)), [65], [3], [[1, 2, 3, 4, 5]])
    with pytest.raises(ValueError, match="scratch slot"):
        inputs.values(list(range(10)), [10], [SCRATCH], [[1]])
    with pytest.raises(ValueError, match="cannot hold"):
        inputs.values(list(range(40)), [40], [3], [[1, 2]])


def test_device_only_offsets_refuse_host_reads() -> None:
    offsets = DeviceOnly("sequence offsets")
    for read in (lambda: offsets[0], lambda: list(offsets), lambda: len(offsets), lambda: max(offsets)):
        with pytest.raises(RuntimeError, match="live on the device only"):
            read()


@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny"])
def test_static_step_equals_eager_prefill_bitexact(preset: str) -> None:
    """No filler, no empty sequence: the same GEMM shapes, so the static step is the eager prefill bit for bit
    (logits, KDA states, conv windows, latents)."""
    eager = _runner(preset)
    ids, ref = _prefill(eager, EXACT, None)
    static = _runner(preset)
    graphs = _graphs(static)
    ids2, cand = _prefill(static, EXACT, graphs)
    assert ids2 == ids and graphs.static_runs == 1 and graphs.shape_for([64] * 4) == PrefillShape(256, 4, 64)
    assert torch.equal(cand, ref)
    want, got = _live(eager, ids), _live(static, ids)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_reused_buffers_follow_the_new_pack_and_fillers_stay_on_scratch() -> None:
    """Two packs of other lengths through one bucket's buffers: the second matches its own eager prefill (not the
    first's offsets), and slots and pages of no live sequence are left as they were."""
    first = [list(range(5, 35)), list(range(40, 90)), list(range(1, 21))]
    second = [list(range(3, 53)), list(range(9, 49))]
    eager = _runner()
    for prompts in (first, second):
        ids, ref = _prefill(eager, prompts, None)
        if prompts is first:
            for sid in ids:
                eager.release(sid)
    static = _runner()
    graphs = _graphs(static)
    ids, _ = _prefill(static, first, graphs)
    for sid in ids:
        static.release(sid)
    pool_before = {k: v.clone() for k, v in static.state_pool.tensors().items()}
    ids, cand = _prefill(static, second, graphs)
    assert graphs.static_runs == 2 and graphs.shape_for([50, 40]) == graphs.shape_for([30, 50, 20])
    # the filler changes GEMM and expert-group shapes: rounding, not bits
    assert torch.allclose(cand, ref, rtol=0, atol=1e-4), (cand - ref).abs().max()
    want, got = _live(eager, ids), _live(static, ids)
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=0, atol=1e-4), key
    live = {static.slot_of(s) for s in ids} | {SCRATCH}
    for k, v in static.state_pool.tensors().items():
        others = [i for i in range(v.shape[1]) if i not in live]
        assert torch.equal(v[:, others], pool_before[k][:, others]), k


def test_continuations_and_unbucketed_packs_run_eagerly() -> None:
    runner = _runner()
    graphs = _graphs(runner)
    runner.admit(0, 80)
    runner.prefill([(0, list(range(40)))], graphs)
    runner.prefill([(0, list(range(40, 70)))], graphs)  # a continuation: its prefix is cached
    assert graphs.static_runs == 1
    small = GraphPrefill(runner.model, max_tokens=128, max_seqs=16, use_graphs=False)
    runner.admit(1, 210)
    runner.prefill([(1, list(range(200)))], small)  # 200 tokens need a bucket of 256: past this one's budget
    assert small.static_runs == 0 and not small.sightings


def test_static_pack_refuses_host_offsets_and_segmented_kda() -> None:
    runner = _runner()
    graphs = _graphs(runner)
    inputs = graphs._static(PrefillShape(64, 1, 64))
    inputs.fill(graphs.staging, [1] * 64, [64], [3], [list(range(1, 9))])
    batch = static_batch(inputs)
    assert batch.num_seqs == 1 and batch.num_tokens == 64 and not batch.has_prefix
    with pytest.raises(RuntimeError, match="live on the device only"):
        _ = batch.seq_lens
    with pytest.raises(ValueError, match="segment_len must be None"):
        runner.model.prefill(batch, segment_len=64)


def test_engine_with_prefill_graphs_matches_offline_greedy() -> None:
    from tests.serving.test_step_loop import _engine_tokens

    prompts = [list(range(10, 40)), list(range(3, 60)), [7] * 20, list(range(100, 110))]
    runner = _runner()
    want = generate_greedy(runner, prompts, 6)
    graphs = _graphs(runner)
    got = _engine_tokens(runner, prompts, 6, max_step_tokens=256, prefill_graphs=graphs)
    assert got == want
    assert graphs.static_runs >= 1


def test_kept_graphs_go_to_the_most_sighted_shapes() -> None:
    """At most max_graphs: a new shape displaces the least sighted graph only when seen more often than it, so two
    shapes seen in turn do not evict each other back and forth (each capture costs a sync and three prefills)."""
    runner = _runner()
    graphs = GraphPrefill(runner.model, max_tokens=512, max_seqs=16, use_graphs=False, max_graphs=2)
    a, b, c = PrefillShape(64, 1, 64), PrefillShape(128, 2, 64), PrefillShape(256, 4, 64)
    kept = (object(), torch.empty(0), ())  # stands for a captured graph: _make_room reads only the keys
    graphs._graphs = {a: kept, b: kept}  # type: ignore[dict-item]
    graphs.sightings.update({a: 5, b: 3, c: 3})
    assert not graphs._make_room(c) and set(graphs._graphs) == {a, b}  # not seen more often than b
    graphs.sightings[c] += 1
    assert graphs._make_room(c) and set(graphs._graphs) == {a} and graphs.evictions == 1


@pytest.mark.parametrize("lens", [[50, 40, 38, 0], [64, 64], [1, 63, 0, 0], [128]])
def test_static_sdpa_gathers_match_the_reference_on_cpu(lens: list[int]) -> None:
    """The CUDA backend of attn.causal_static is plain torch (device gathers, one causal SDPA): run on the CPU in
    fp32 it equals the per-sequence reference over packs with empty trailing sequences, so its index math is held
    here, not first on the H200. Control: the same call with the offsets of another pack."""
    from k3verify.kernels.attn import packed
    from k3verify.kernels.varlen import DeviceSeqlens
    from k3verify.serving.batch import segment_ids

    g = torch.Generator().manual_seed(len(lens))
    T, h, d, dv = sum(lens), 3, 24, 16
    q, k, v = torch.randn(T, h, d, generator=g), torch.randn(T, h, d, generator=g), torch.randn(T, h, dv, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    seg = segment_ids(cu, T)
    local = torch.arange(T) - cu[seg]
    static = DeviceSeqlens(cu, T, max(64, max(lens)))
    ref = packed.causal_attention_static_torch(q, k, v, static, seg, local, d**-0.5)
    cand = packed.causal_attention_static_sdpa(q, k, v, static, seg, local, d**-0.5)
    torch.testing.assert_close(cand, ref, rtol=1e-5, atol=1e-5)
    if len([n for n in lens if n]) > 1:  # another pack's offsets: sequences attend across their boundary
        other = DeviceSeqlens(torch.tensor([0, T, *[T] * (len(lens) - 1)]), T, max(64, T))
        wrong = packed.causal_attention_static_sdpa(q, k, v, other, torch.zeros_like(seg), torch.arange(T), d**-0.5)
        assert not torch.allclose(wrong, ref, rtol=1e-3, atol=1e-3)


def test_a_pack_without_its_own_graph_borrows_the_smallest_larger_one() -> None:
    """A kept graph of a larger bucket (at most MAX_BORROW x the pack's own tokens, valid over these caches) takes a
    pack whose own bucket has no graph yet: more padding replayed instead of a host-bound eager prefill."""
    from k3verify.serving.graphs import capture_signature
    from k3verify.serving.prefill_graphs import MAX_BORROW, fits

    runner = _runner()
    graphs = GraphPrefill(runner.model, max_tokens=1024, max_seqs=32, use_graphs=False)
    own = graphs.shape_for([128] * 3)
    assert own == PrefillShape(384, 4, 128)
    big, bigger, too_big, narrow = (PrefillShape(512, 4, 128), PrefillShape(768, 8, 128),
                                    PrefillShape(1024, 8, 128), PrefillShape(512, 8, 64))
    assert fits(big, [128] * 3) and fits(bigger, [128] * 3) and not fits(narrow, [128] * 3)
    assert not fits(PrefillShape(512, 3, 128), [128] * 3)  # 3 live + 1 filler need 4 sequences
    sig = capture_signature(runner.model)
    graphs._graphs = {s: (object(), torch.empty(0), sig) for s in (bigger, too_big, narrow, big)}  # type: ignore[misc]
    assert too_big.num_tokens > MAX_BORROW * own.num_tokens
    assert graphs._larger_fit(own, [128] * 3) == big
    graphs._graphs[big] = (object(), torch.empty(0), ())  # type: ignore[assignment]  # captured over other caches
    assert graphs._larger_fit(own, [128] * 3) == bigger
