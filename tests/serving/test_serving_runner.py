"""The engine-facing ModelRunner API and offline greedy generation."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from k3verify.serving.batch import PackedBatch
from k3verify.serving.kv_cache import CacheError
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner, generate_greedy


def _runner(model: ServingModel, **kw: int) -> ModelRunner:
    args = {"num_pages": 17, "page_size": 8, "num_slots": 3, "max_context": 100} | kw
    return ModelRunner(model, **args)


def test_capacity_questions(build_model: Callable[..., ServingModel]) -> None:
    r = _runner(build_model("kl-tiny"))
    assert r.max_context == 100
    assert r.can_ever_fit(100) and not r.can_ever_fit(101) and not r.can_ever_fit(0)
    assert r.can_admit(100)
    r.admit(1, 100)  # 13 of 16 pages
    assert not r.can_admit(40) and r.can_admit(24) and r.can_ever_fit(40)
    r.admit(2, 8)
    r.admit(3, 8)
    assert not r.can_admit(1)  # pages left, but no state slot
    with pytest.raises(CacheError, match="do not fit now"):
        r.admit(4, 1)
    with pytest.raises(ValueError, match="already admitted"):
        r.admit(1, 5)
    with pytest.raises(CacheError, match="can never fit"):
        r.admit(9, 1000)
    r.check_integrity()
    for sid in (1, 2, 3):
        r.release(sid)
    assert r.active_ids == [] and r.can_admit(100)
    r.check_integrity()


def test_prefill_decode_match_full_recompute(build_model: Callable[..., ServingModel]) -> None:
    """Packed prefill (two sequences, one continued in a second pack) then decode steps give the logits
    of one cacheless forward over each whole sequence."""
    model = build_model("k3-tiny")
    g = torch.Generator().manual_seed(0)
    seqs = {sid: torch.randint(0, 4000, (n,), generator=g).tolist() for sid, n in ((1, 30), (2, 25))}
    r = _runner(model)
    r.admit(1, 30)
    r.admit(2, 25)
    first = r.prefill([(1, seqs[1][:12]), (2, seqs[2][:20])])
    second = r.prefill([(1, seqs[1][12:26])])
    steps = [r.decode([(1, seqs[1][26 + i]), (2, seqs[2][20 + i])]) for i in range(4)]
    assert r.num_cached(1) == 30 and r.num_cached(2) == 24
    full = {sid: model.prefill(PackedBatch.build(torch.tensor(s), [len(s)]), all_logits=True).all_logits
            for sid, s in seqs.items()}
    torch.testing.assert_close(first[0], full[1][11], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(first[1], full[2][19], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second[0], full[1][25], rtol=1e-4, atol=1e-4)
    for i, step in enumerate(steps):
        torch.testing.assert_close(step[0], full[1][26 + i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(step[1], full[2][20 + i], rtol=1e-4, atol=1e-4)
    assert first.dtype == torch.float32 and first.shape == (2, model.cfg.vocab_size)
    r.check_integrity()


def test_runner_refuses_misuse(build_model: Callable[..., ServingModel]) -> None:
    r = _runner(build_model("kl-tiny"))
    r.admit(1, 5)
    with pytest.raises(KeyError, match="not admitted"):
        r.prefill([(2, [1, 2])])
    with pytest.raises(CacheError, match="exceed its admitted budget"):
        r.prefill([(1, [1, 2, 3, 4, 5, 6])])
    with pytest.raises(ValueError, match="no tokens"):
        r.prefill([(1, [])])
    with pytest.raises(ValueError, match="appears twice"):
        r.decode([(1, 3), (1, 4)])
    r.prefill([(1, [1, 2, 3, 4, 5])])
    with pytest.raises(CacheError, match="exceeds its budget"):
        r.decode([(1, 3)])
    with pytest.raises(KeyError):
        r.release(2)
    r.release(1)
    r.check_integrity()


def test_generate_greedy_matches_recompute_and_runs_in_waves(build_model: Callable[..., ServingModel]) -> None:
    """Three prompts through a runner with room for two at a time: the same tokens as argmax over a full
    forward each step; the cache is empty afterwards."""
    model = build_model("k3-tiny")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (5, 14, 9)]
    r = _runner(model, num_slots=2)
    got = generate_greedy(r, prompts, 5)
    for prompt, toks in zip(prompts, got, strict=True):
        seq = list(prompt)
        for _ in range(5):
            out = model.prefill(PackedBatch.build(torch.tensor(seq), [len(seq)]))
            seq.append(int(out.logits.argmax()))
        assert toks == seq[len(prompt):]
    assert r.active_ids == []
    r.check_integrity()
    stop = generate_greedy(r, [prompts[0]], 5, eos_token_ids={got[0][1]})
    assert stop == [got[0][:2]]


def test_packed_batch_validation() -> None:
    ids = torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError, match="at least one token"):
        PackedBatch.build(ids, [5, 0])
    with pytest.raises(ValueError, match="sum"):
        PackedBatch.build(ids, [2, 2])
    with pytest.raises(ValueError, match="non-scratch state slot"):
        PackedBatch.build(ids, [2, 3], slots=[1, 0])
    with pytest.raises(ValueError, match="cannot hold"):
        PackedBatch.build(ids, [2, 3], page_tables=[[1], [2]], page_size=2, start_pos=[0, 0])
    b = PackedBatch.build(ids, [2, 3], start_pos=[4, 0], page_tables=[[1, 2, 3], [4, 5]], page_size=2)
    assert b.seg_ids.tolist() == [0, 0, 1, 1, 1] and b.positions.tolist() == [4, 5, 0, 1, 2]
    assert b.page_table.tolist() == [[1, 2, 3], [4, 5, 0]] and b.last_token_index.tolist() == [1, 4]


def test_a_runner_whose_caches_another_runner_replaced_refuses_to_run(
        build_model: Callable[..., ServingModel]) -> None:
    """The model owns the caches a runner works on: a second runner over the same model allocates new ones, and the
    first would have read and written those (its own sequences' states gone: a score gave other tokens than
    decode, 2026-12-02). The first runner now raises; after reset_caches it is the model's again and runs."""
    model = build_model("kl-tiny")
    first = _runner(model)
    first.admit(1, 20)
    _runner(model)
    with pytest.raises(RuntimeError, match="no longer the model's"):
        first.prefill([(1, [3, 4, 5])])
    first.reset_caches()
    first.admit(1, 20)
    assert first.prefill([(1, [3, 4, 5])]).shape[0] == 1
