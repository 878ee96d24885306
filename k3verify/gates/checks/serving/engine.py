"""Serving checks above the model: the stop ids the engine honours, and KDA state-slot reuse.

- eos ids: a checkpoint carries two eos ids ([EOS] in config.json, <|im_end|> in generation_config.json);
  the engine that `serve` builds must stop at both. Reference: the ids read straight from the two JSON
  files; control: config.json's alone. A checkpoint whose two files name the same eos cannot tell them
  apart, so a copy of its config with a differing generation eos is checked beside it.
- slot reuse: a freed slot may hold anything (NaN from a request that failed); allocation must hand
  out a clean one. A packed prefill mixing a continuing sequence with a fresh one on a NaN-poisoned
  reused slot must equal the same pass on a fresh pool; control: allocation that skips the zeroing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from k3verify.config import ModelConfig
from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.patch import patched
from k3verify.serving.engine import Engine
from k3verify.serving.runner import ModelRunner
from k3verify.serving.state_cache import KDAStatePool
from k3verify.tokenizer import KimiTokenizer


def _json_eos(path: Path) -> list[int]:
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    data = data.get("text_config", data)
    eos = data.get("eos_token_id")
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _engine_eos(ctx: CheckContext, ckpt: Path, tokenizer: KimiTokenizer) -> list[int]:
    """The eos ids of the engine `serve --checkpoint ckpt` builds (config parsed the way serve parses it)."""
    cfg = ModelConfig.from_file(ckpt)
    runner = ModelRunner(builders.served_model(ctx), num_pages=4, page_size=16, num_slots=1, max_context=32)
    engine = Engine(runner, tokenizer, eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size)
    return sorted(engine.eos_token_ids)


def _distinguishing_copy(ckpt: Path, tokenizer: KimiTokenizer, out: Path) -> int:
    """config.json copied, and a generation_config.json whose eos is an id config.json does not name
    (<|im_end|> where possible): the case a checkpoint with equal eos ids in both files never exercises."""
    config_eos = set(_json_eos(ckpt / "config.json"))
    candidates = [tokenizer.im_end_id, *range(tokenizer.num_base_tokens, tokenizer.n_vocab)]
    extra = next(i for i in candidates if i not in config_eos)
    out.mkdir()
    shutil.copyfile(ckpt / "config.json", out / "config.json")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": extra}))
    return extra


@register_check(id="serving.engine.eos_ids", component="serving", level="serving", kind=Kind.BITEXACT,
                control="only config.json's eos id honoured (generation_config.json's eos dropped)")
def check_engine_eos_ids(ctx: CheckContext) -> Trial:
    """Two cases: the checkpoint as it is, and a copy whose generation_config.json names an eos config.json
    does not (built here, so a checkpoint with the same eos in both files still tests the merge)."""
    ckpt = Path(ctx.checkpoint_dir)
    tokenizer = KimiTokenizer.from_dir(ckpt)
    ref: dict[str, torch.Tensor] = {}
    cand: dict[str, torch.Tensor] = {}
    ctrl: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory(prefix="k3v-eos-") as tmp:
        extra = _distinguishing_copy(ckpt, tokenizer, Path(tmp) / "ckpt")
        for key, where in (("checkpoint", ckpt), ("distinguishing", Path(tmp) / "ckpt")):
            config_only = sorted(set(_json_eos(where / "config.json")))
            ref[key] = torch.tensor(sorted(set(config_only) | set(_json_eos(where / "generation_config.json"))))
            cand[key] = torch.tensor(_engine_eos(ctx, where, tokenizer))
            ctrl[key] = torch.tensor(config_only)
    same = torch.equal(ref["checkpoint"], ctrl["checkpoint"])
    return Trial(reference=ref, candidate=cand, control=ctrl,
                 notes=[f"checkpoint: config.json + generation_config.json eos ids {ref['checkpoint'].tolist()}"
                        + (" (both files name the same ids: only the distinguishing case can catch the control)"
                           if same else ""),
                        f"distinguishing case: generation_config.json eos {extra} added to config.json's "
                        f"{ctrl['distinguishing'].tolist()}"])


def _mixed_pass(ctx: CheckContext, poison: bool) -> torch.Tensor:
    """Sequence 0 prefills then continues; a released slot (poisoned with NaN) is re-allocated to a
    fresh sequence that prefills in the same pack as the continuation -> [2, V] logits."""
    runner = ModelRunner(builders.served_model(ctx), num_pages=16, page_size=16, num_slots=2, max_context=96)
    a, b = builders.prompt(ctx, 11, salt=1).tolist(), builders.prompt(ctx, 9, salt=2).tolist()
    runner.admit(0, 40)
    runner.admit(1, 40)
    runner.prefill([(0, a), (1, b)])
    released = runner.slot_of(1)
    runner.release(1)
    if poison:
        for t in runner.state_pool.tensors().values():
            t[:, released] = float("nan")
    runner.admit(2, 40)
    if runner.slot_of(2) != released:
        raise RuntimeError("the pool did not hand the released slot back: the check would test nothing")
    out = runner.prefill([(0, a[:3]), (2, b)])
    runner.release(0)
    runner.release(2)
    return out


@register_check(id="serving.state.slot_reuse", component="serving", level="serving", kind=Kind.BITEXACT,
                control="a re-allocated slot keeps the NaN its previous owner left")
@builders.single_thread
def check_state_slot_reuse(ctx: CheckContext) -> Trial:
    if not ctx.cfg.has_kda:
        raise SkipCheck("preset has no KDA layers")
    reference = _mixed_pass(ctx, poison=False)
    candidate = _mixed_pass(ctx, poison=True)
    keep_garbage = KDAStatePool.allocate

    def no_zeroing(self: KDAStatePool) -> int:
        slot = self._free.popleft()
        self._used.add(slot)
        return slot
    with patched(KDAStatePool, "allocate", no_zeroing):
        control = _mixed_pass(ctx, poison=True)
    assert KDAStatePool.allocate is keep_garbage
    return Trial(reference=reference, candidate=candidate, control=control,
                 notes=["pack: a continuation (3 tokens after 11) + a fresh 9-token prompt on the reused slot"])
