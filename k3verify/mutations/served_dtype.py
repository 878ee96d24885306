"""Faults the served-model checks must see: one only the serving dtype shows (the fp32 checks cannot see it,
`parity --dtype bfloat16` must), and one the layer-by-layer real-size check must see on its own."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

MUTANTS = [
    Mutant(
        id="served_dtype.bf16_prefill_state_dropped",
        fault="in a bf16 model the prefill's final KDA state is not written back (only the fp32 path stores it), "
              "so decode starts from a zero state",
        target="k3verify.serving.layers.kda:KimiDeltaAttention.forward",
        old="pool.store_state(self.layer_idx, b.slots, state)",
        new="pool.store_state(self.layer_idx, b.slots, state if x.dtype == torch.float32 else state * 0)",
        presets=("kl-tiny",),
        killers=["served.*"],
    ),
    Mutant(
        id="served_dtype.kda_q_scale",
        fault="KDA scales q by head_dim^-0.25 instead of head_dim^-0.5",
        target="k3verify.serving.layers.kda:KimiDeltaAttention.forward",
        old="scale = dk**-0.5  # q's scale, decode and prefill alike",
        new="scale = dk**-0.25  # q's scale, decode and prefill alike",
        presets=("k3-tiny", "kl-tiny"),
        killers=["model.layerwise.sublayers"],
    ),
]
