"""Packing and engine faults: segment ids of a packed batch, eos handling, the state pool's scratch slot."""

from __future__ import annotations

from k3verify.mutate import Mutant

MUTANTS = [
    Mutant(
        id="serving.pack.bucketize_right_false", quick=True,
        fault="segment ids come from bucketize(right=False): every sequence's first token lands in the previous one",
        target="k3verify.serving.batch:segment_ids",
        old="return torch.bucketize(positions, cu_seqlens, right=True) - 1",
        new="return torch.bucketize(positions, cu_seqlens, right=False) - 1",
        killers=["serving.*", "kda.*", "mla.*"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="serving.engine.one_eos_only",
        fault="the engine stops only at the first eos id (tokenizer_config's) and runs past generation_config's",
        target="k3verify.serving.engine:Engine.__init__",
        old="self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)",
        new="self.eos_token_ids = frozenset(int(e) for e in list(eos_token_ids)[:1])",
        killers=["serving.*"],
    ),
    Mutant(
        id="serving.state_pool.scratch_handed_out",
        fault="the KDA state pool hands out the reserved scratch slot 0, where padded rows park",
        target="k3verify.serving.state_cache:KDAStatePool.__init__",
        old="self._free: deque[int] = deque(range(1, n))",
        new="self._free: deque[int] = deque(range(0, n - 1))",
        killers=["serving.*"],
    ),
    Mutant(
        id="serving.state_pool.slot_not_zeroed",
        fault="a newly allocated KDA slot keeps the previous owner's state and conv windows",
        target="k3verify.serving.state_cache:KDAStatePool.allocate",
        old="        for t in self.tensors().values():\n            t[:, slot].zero_()\n",
        new="",
        killers=["serving.*"],
    ),
]
