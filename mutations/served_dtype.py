"""Faults only the serving dtype shows: the fp32 checks cannot see them, `parity --dtype bfloat16` must."""

from __future__ import annotations

from k3verify.gates.mutation import Mutant

MUTANTS = [
    Mutant(
        id="served_dtype.bf16_prefill_state_dropped",
        fault="in a bf16 model the prefill's final KDA state is not written back (only the fp32 path stores it), "
              "so decode starts from a zero state",
        target="k3verify.serving.layers.kda:KimiDeltaAttention.forward",
        old="pool.store_state(self.layer_idx, b.slots, state)",
        new="pool.store_state(self.layer_idx, b.slots, state if x.dtype == torch.float32 else state * 0)",
        presets=("kl-tiny",),
        killers=["model.served.vs_gold"],
    ),
]
