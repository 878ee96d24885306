"""Serving checks above the model: the stop ids the engine honours, and KDA state-slot reuse.

- eos ids: a checkpoint carries two eos ids ([EOS] in config.json, <|im_end|> in generation_config.json);
  the engine that `serve` builds must stop at both. Reference: the ids read straight from the two JSON
  files; control: config.json's alone.
- slot reuse: a freed slot may hold anything (NaN from a request that failed); allocation must hand
  out a clean one. A packed prefill mixing a continuing sequence with a fresh one on a NaN-poisoned
  reused slot must equal the same pass on a fresh pool; control: allocation that skips the zeroing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from k3verify.config import ModelConfig
from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates import fixtures as fx
from k3verify.serving.engine import Engine
from k3verify.serving.runner import ModelRunner
from k3verify.serving.state_cache import KDAStatePool
from k3verify.tokenizer import KimiTokenizer


def _json_eos(path: Path) -> list[int]:
    data = json.loads(path.read_text())
    data = data.get("text_config", data)
    eos = data.get("eos_token_id")
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]


@register_check(id="serving.engine.eos_ids", component="serving", level="serving", kind=Kind.BITEXACT,
                control="only config.json's eos id honoured (generation_config.json's <|im_end|> dropped)")
def check_engine_eos_ids(ctx: CheckContext) -> Trial:

    ckpt = ctx.checkpoint_dir
    if ckpt is None or not (Path(ckpt) / "generation_config.json").is_file():
        raise SkipCheck("needs a checkpoint directory with generation_config.json")
    ckpt = Path(ckpt)
    expected = sorted(set(_json_eos(ckpt / "config.json")) | set(_json_eos(ckpt / "generation_config.json")))
    cfg = ModelConfig.from_file(ckpt)  # the path `serve --checkpoint` takes
    runner = ModelRunner(fx.serving_model(ctx), num_pages=4, page_size=16, num_slots=1, max_context=32)
    engine = Engine(runner, KimiTokenizer.from_dir(ckpt), eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size)
    return Trial(reference=torch.tensor(expected), candidate=torch.tensor(sorted(engine.eos_token_ids)),
                 control=torch.tensor(sorted(set(_json_eos(ckpt / "config.json")))),
                 notes=[f"config.json + generation_config.json eos ids: {expected}"])


def _mixed_pass(ctx: CheckContext, poison: bool) -> torch.Tensor:
    """Sequence 0 prefills then continues; a released slot (poisoned with NaN) is re-allocated to a
    fresh sequence that prefills in the same pack as the continuation -> [2, V] logits."""
    runner = ModelRunner(fx.serving_model(ctx), num_pages=16, page_size=16, num_slots=2, max_context=96)
    a, b = fx.prompt(ctx, 11, salt=1).tolist(), fx.prompt(ctx, 9, salt=2).tolist()
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
@fx.single_thread
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
    with fx.patched(KDAStatePool, "allocate", no_zeroing):
        control = _mixed_pass(ctx, poison=True)
    assert KDAStatePool.allocate is keep_garbage
    return Trial(reference=reference, candidate=candidate, control=control,
                 notes=["pack: a continuation (3 tokens after 11) + a fresh 9-token prompt on the reused slot"])
