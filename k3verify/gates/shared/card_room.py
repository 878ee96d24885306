"""Room on the card for the models a run builds, and the sizes it plans with (gates/shared/builders.py).

A run caches the models its checks share; at real size on one card they do not all fit at once, so before a model
is built the cached ones are dropped, oldest first and the served model last, until the card has room for it.
"""

from __future__ import annotations

import functools
import gc
import math

import torch

from k3verify.checkpoint.names import module_specs
from k3verify.config import ModelConfig
from k3verify.gates.core.check import CheckContext
from k3verify.gates.core.suite import holds_a_model
from k3verify.gates.shared.slice import PARENT_CACHE, SLICE_CACHE
from k3verify.plan.device_fit import free_bytes

HEADROOM_BYTES = 4 << 30  # kept free past what a model needs: activations, workspaces, the allocator's slack


def make_room(ctx: CheckContext, need_bytes: int, what: str, last: str) -> None:
    """On CUDA, before building `what` (need_bytes): if the card's free memory (with what torch holds unused)
    is short of it plus HEADROOM_BYTES, drop cached models of this run, oldest first and the one under the key
    `last` (the served model) last, until it is not; each later check that needs one builds it again. The result
    says what was dropped."""
    if ctx.device.type != "cuda":
        return
    caches = [ctx.cache]
    for extra in (ctx.cache.get(PARENT_CACHE), ctx.cache.get(SLICE_CACHE)):
        if isinstance(extra, dict):
            caches.append(extra)
    victims = [(c, k) for c in caches for k, v in c.items() if holds_a_model(v) and k != last]
    victims += [(c, k) for c in caches for k, v in c.items() if holds_a_model(v) and k == last]
    dropped = []
    while free_bytes(ctx.device) < need_bytes + HEADROOM_BYTES and victims:
        cache, key = victims.pop(0)
        del cache[key]
        dropped.append(key)
        gc.collect()
        torch.cuda.empty_cache()
    if dropped:
        ctx.run_notes.append(f"dropped cached {', '.join(dropped)} to build {what} ({need_bytes / 2**30:.1f} GiB; "
                             f"{free_bytes(ctx.device) / 2**30:.1f} GiB free after)")


@functools.cache
def parameter_counts(cfg: ModelConfig) -> tuple[int, tuple[int, ...]]:
    """Parameters of the text model outside its decoder layers, and in each layer, MXFP4 experts counted dense (two
    values per packed byte)."""
    outside, layers = 0, [0] * cfg.num_hidden_layers
    for name, spec in module_specs(cfg).items():
        if name.endswith(".weight_scale"):
            continue
        count = math.prod(spec.shape) * (2 if name.endswith(".weight_packed") else 1)
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            layers[int(parts[2])] += count
        else:
            outside += count
    return outside, tuple(layers)


def largest_layer_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One decoder layer's weights in `dtype`, the largest: what a layer-at-a-time oracle holds."""
    return max(parameter_counts(cfg)[1], default=0) * torch.empty((), dtype=dtype).element_size()
