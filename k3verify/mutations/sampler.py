"""Sampler faults: the temperature, the top-k mask, the Gumbel noise and its key (serving/sampler.py)."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

MUTANTS = [
    Mutant(
        id="serving.sampler.temperature_ignored", quick=True,
        fault="sampled rows draw from softmax(z) whatever temperature the request asked for",
        target="k3verify.serving.sampler:masked_scaled_logits",
        old="scaled = (z - z.max(dim=-1, keepdim=True).values) / _host_column(temps, torch.float32, z.device)",
        new="scaled = z - z.max(dim=-1, keepdim=True).values",
        killers=["serving.sampler.tempered_softmax"],
    ),
    Mutant(
        id="serving.sampler.top_k_keeps_one_more",
        fault="the top-k mask keeps k + 1 tokens (rank > k instead of rank >= k)",
        target="k3verify.serving.sampler:_filter_sorted",
        old="drop = rank >= _host_column(ks, torch.int64, scaled.device)",
        new="drop = rank > _host_column(ks, torch.int64, scaled.device)",
        killers=["serving.sampler.tempered_softmax"],
    ),
    Mutant(
        id="serving.sampler.gumbel_negated",
        fault="the noise is a negated Gumbel (log(-log u)): argmax then favours the wrong tail",
        target="k3verify.serving.sampler:gumbel_noise",
        old="return -torch.log(-torch.log(uniform_noise(seeds, positions, vocab)))",
        new="return torch.log(-torch.log(uniform_noise(seeds, positions, vocab)))",
        killers=["serving.sampler.tempered_softmax"],
    ),
    Mutant(
        id="serving.sampler.noise_keyed_by_batch_row", quick=True,
        fault="the noise key mixes in the row's place in the batch, so a seeded request's draws depend on its "
              "neighbours",
        target="k3verify.serving.sampler:uniform_noise",
        old="key = _mix32(key ^ (positions & _M32))[:, None]",
        new="key = _mix32(key ^ (positions & _M32) ^ torch.arange(seeds.numel(), device=seeds.device))[:, None]",
        killers=["serving.sampler.seeded_batch_invariant"],
    ),
]
