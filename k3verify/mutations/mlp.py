"""Dense MLP / GLU activation faults (SiTU, SiLU, gate/up wiring, token tiling)."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

MLP = "k3verify.serving.layers.mlp"

MUTANTS = [
    Mutant(
        id="mlp.silu_for_situ", quick=True,
        fault="K3's SiTU gate activation beta*tanh(g/beta)*sigmoid(g) is computed as plain SiLU g*sigmoid(g)",
        target=f"{MLP}:situ_glu",
        old="a = beta * torch.tanh(g / beta) * torch.sigmoid(g)",
        new="a = g * torch.sigmoid(g)",
        killers=["mlp.*", "moe.*"],
    ),
    Mutant(
        id="mlp.situ_linear_beta_dropped",
        fault="SiTU's up-branch cap beta_lin*tanh(u/beta_lin) (activation_situ_linear_beta) is skipped",
        target=f"{MLP}:situ_glu",
        old="    if linear_beta is not None:\n        u = linear_beta * torch.tanh(u / linear_beta)",
        new="    if False:\n        u = linear_beta * torch.tanh(u / linear_beta)",
        killers=["mlp.*", "moe.*"],
    ),
    Mutant(
        id="mlp.situ_in_activation_dtype",
        fault="SiTU runs in the activation dtype instead of fp32 (changes nothing in an fp32 model; bf16 only)",
        target=f"{MLP}:situ_glu",
        old="g, u = gate.float(), up.float()",
        new="g, u = gate, up",
        killers=["mlp.*", "moe.*"],
    ),
    Mutant(
        id="mlp.gate_up_swapped", quick=True,
        fault="the dense GLU feeds up_proj into the activation and multiplies by gate_proj",
        target=f"{MLP}:GatedMLP._glu",
        old="gate, up = self.gate_up(x)",
        new="up, gate = self.gate_up(x)",
        killers=["mlp.*"], presets=("k3-tiny", "kl-tiny"),
    ),
    Mutant(
        id="mlp.silu_glu_no_gate_activation",
        fault="the SiLU-GLU multiplies the raw gate projection by up (SiLU missing)",
        target=f"{MLP}:silu_glu",
        old="return F.silu(gate) * up",
        new="return gate * up",
        killers=["mlp.*", "moe.*"], presets=("kl-tiny",),
    ),
    Mutant(
        id="mlp.tile.ragged_last_tile",
        fault="FFN token tiling leaves a short ragged last tile instead of merging it (other GEMM kernel, other bits)",
        target=f"{MLP}:even_tiles",
        old="if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < TILE_ALIGN:",
        new="if False:",
        killers=["mlp.*", "moe.*", "serving.*"],
    ),
    Mutant(
        id="mlp.tile.last_row_dropped",
        fault="FFN token tiles stop one row short, leaving the last token's output unwritten",
        target=f"{MLP}:even_tiles",
        old="bounds = [(a, min(a + size, total)) for a in range(0, total, size)]",
        new="bounds = [(a, min(a + size, total - 1)) for a in range(0, total, size)]",
        killers=["mlp.*", "moe.*", "serving.*"],
    ),
]
