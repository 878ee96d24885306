"""One gloo world per parity run for the dist.* checks: the ranks build the parallel model under three
layouts (TP only, EP only, the requested one), run the same inputs the single-process reference runs, and
also run every control (a deliberately broken parallel model) so that one spawn serves all the checks. The
EP-only layout is also built in bf16, for its MoE blocks' precision (gates/shared/dist_arithmetic.py).

Each rank writes what it computed to `<out_dir>/rank<r>.pt`; `run_session` waits for the world and returns
those dicts, rank by rank. The controls break the parallel model from outside (patching one instance), never
the shipped code: the mutation catalog breaks the code itself.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3verify.checkpoint.hf_interop import normalize_hf_names
from k3verify.checkpoint.reader import CheckpointReader
from k3verify.config import ModelConfig
from k3verify.gates.shared.dist_arithmetic import moe_inputs, moe_outputs, partials_rounded
from k3verify.gates.shared.patch import patched, patched_all
from k3verify.serving.batch import PackedBatch
from k3verify.serving.layers.kda import KimiDeltaAttention
from k3verify.serving.layers.mla import MultiHeadLatentAttention
from k3verify.serving.parallel.comm import Comm, init_world, leave_world
from k3verify.serving.parallel.launch import spawn_world
from k3verify.serving.parallel.layers import RowParallelLinear
from k3verify.serving.parallel.layout import ParallelLayout, split_range
from k3verify.serving.parallel.model import ParallelServingModel
from k3verify.serving.parallel.moe import ParallelMoE
from k3verify.serving.parallel.shards import SliceSpec, Tensors, load_rank, read_spec
from k3verify.serving.runner import ModelRunner, generate_greedy

UNCHOSEN_BIAS = -1.0e4  # added to a correction bias, no sigmoid score (< 1) can lift the expert into a top-k


@dataclass(frozen=True)
class SessionSpec:
    checkpoint_dir: str
    names: str  # Target.names: "transformers" spellings are read through hf_interop's name map
    tp: int
    ep: int
    out_dir: str
    pack: list[list[int]]  # prefill sequences (one packed batch)
    prompts: list[list[int]]  # greedy prompts
    steps: int
    seed: int = 0  # of the bf16 MoE blocks' inputs (dist_precision.moe_inputs)

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    def layouts(self) -> dict[str, tuple[int, int]]:
        """name -> (tp, ep): TP only, EP only, and the layout the run asked for."""
        w = self.world
        return {"tp": (w, 1), "ep": (1, w), "asked": (self.tp, self.ep)}


def layout_key(tp: int, ep: int) -> str:
    return f"tp{tp}_ep{ep}"


def greedy(model: ParallelServingModel | Any, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens through the runner (packed prefill, paged caches, decode)."""
    runner = ModelRunner(model, num_pages=32, page_size=8, num_slots=len(prompts), max_context=248)
    return generate_greedy(runner, prompts, steps)


_EXPERT_SOURCE = re.compile(r"^(.*\.experts\.)(\d+)(\..*)$")


def mis_sliced_read(cfg: ModelConfig, layout: ParallelLayout) -> Callable[[Tensors, SliceSpec], torch.Tensor]:
    """A mis-sliced load of `layout`: every split tensor's window moved by one row (same shape, wrong rows), and
    where the layout splits experts, every rank's experts read from the next global id (expert g gets g + 1's
    weights): the wrong experts under the right local names. A layout that splits neither has no such fault."""
    shift_experts = layout.ep > 1 and cfg.num_experts > 1

    def read(tensors: Tensors, spec: SliceSpec) -> torch.Tensor:
        if spec.dim is None:
            m = _EXPERT_SOURCE.match(spec.source) if shift_experts else None
            if m is None:
                return read_spec(tensors, spec)
            wrong = f"{m.group(1)}{(int(m.group(2)) + 1) % cfg.num_experts}{m.group(3)}"
            return read_spec(tensors, SliceSpec(wrong))
        shape = tensors.entries[spec.source].shape if isinstance(tensors, CheckpointReader) else \
            tensors[spec.source].shape
        step = 1 if spec.stop < shape[spec.dim] else -1
        return read_spec(tensors, SliceSpec(spec.source, spec.dim, spec.start + step, spec.stop + step))

    return read


def splits_anything(cfg: ModelConfig, layout: ParallelLayout) -> bool:
    """Whether `layout` cuts any checkpoint tensor (tp > 1: heads, columns, vocabulary) or deals experts out
    (ep > 1 with routed experts): otherwise every rank loads the whole model and a mis-sliced load cannot exist."""
    return layout.tp > 1 or (layout.ep > 1 and any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)))


@contextlib.contextmanager
def unreduced_attention(model: ParallelServingModel) -> Iterator[None]:
    """Control: TP attention returns its partial sum (the all-reduce after o_proj is missing)."""
    with contextlib.ExitStack() as stack:
        for m in model.modules():
            if isinstance(m, KimiDeltaAttention | MultiHeadLatentAttention) and isinstance(m.o_proj, RowParallelLinear):
                stack.enter_context(patched(m.o_proj, "forward", m.o_proj.partial_sum))
        yield


@contextlib.contextmanager
def bf16_reduce(comm: Comm) -> Iterator[None]:
    """Control: partial sums reduced in bf16 (each rank's partial rounded, the sum rounded again)."""
    def reduce(t: torch.Tensor) -> torch.Tensor:
        buf = t.to(torch.bfloat16)
        torch.distributed.all_reduce(buf, group=comm.group)
        return buf.to(t.dtype)

    with patched(comm, "all_reduce", reduce):
        yield


@contextlib.contextmanager
def unchosen_experts(moe_layers: list[Any], num_experts: int, world: int) -> Iterator[None]:
    """Make the last rank's experts unchoosable in every MoE layer after the first: that rank receives no
    token there (its partial sum is zeros) while it did in the first MoE layer."""
    first, stop = split_range(num_experts, world, world - 1)
    saved = [m.gate.e_score_correction_bias.detach().clone() for m in moe_layers]
    for m in moe_layers[1:]:
        m.gate.e_score_correction_bias.data[first:stop] += UNCHOSEN_BIAS
    try:
        yield
    finally:
        for m, bias in zip(moe_layers, saved, strict=True):
            m.gate.e_score_correction_bias.data.copy_(bias)


@contextlib.contextmanager
def stale_partials(model: ParallelServingModel) -> Iterator[None]:
    """Control: a rank whose experts got no token re-sends the last partial sum it computed (a reused
    buffer) instead of zeros."""
    last: dict[str, torch.Tensor] = {}
    mods = model.moe_layers()

    def make(m: ParallelMoE) -> Any:
        def routed(x_in: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            out = ParallelMoE.routed_partial(m, x_in, weights, idx)
            if m.rows_routed:
                last["partial"] = out.clone()
            elif "partial" in last and last["partial"].shape == out.shape:
                return last["partial"]
            return out
        return routed

    with contextlib.ExitStack() as stack:
        for m in mods:
            stack.enter_context(patched(m, "routed_partial", make(m)))
        yield


def _build(cfg: ModelConfig, tp: int, ep: int, rank: int, tensors: Tensors,
           dtype: torch.dtype = torch.float32) -> ParallelServingModel:
    return ParallelServingModel(cfg, Comm(ParallelLayout(tp, ep, rank)), dtype, "cpu").load(tensors)


def prefill_logits(model: Any, pack: list[list[int]], captures: dict[str, torch.Tensor] | None = None
                   ) -> torch.Tensor:
    """All-token fp32 logits of one packed prefill; with `captures`, also each sublayer's output (for
    localization over depth)."""
    ids = torch.tensor([t for seq in pack for t in seq], dtype=torch.long)
    batch = PackedBatch.build(ids, [len(seq) for seq in pack], device=model.device)
    out = model.prefill(batch, all_logits=True, capture=captures is not None)
    if captures is not None:
        captures.update(out.captures)
    logits: torch.Tensor = out.all_logits
    return logits


def empty_rank_step(model: Any, pack: list[list[int]], world: int) -> dict[str, Any]:
    """Prefill with the last rank's experts unchosen after the first MoE layer: logits, and per MoE layer the
    (token, expert) rows this rank ran. Works on the single-process model too (world = the parallel world)."""
    layers = [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    captures: dict[str, torch.Tensor] = {}
    with unchosen_experts(layers, model.cfg.num_experts, world):
        logits = prefill_logits(model, pack, captures)
    return {"logits": logits, "captures": captures, "rows": [getattr(m, "rows_routed", -1) for m in layers]}


def _run_layouts(spec: SessionSpec, cfg: ModelConfig, rank: int, tensors: Tensors,
                 models: dict[str, ParallelServingModel]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (tp, ep) in spec.layouts().items():
        model = models[name] = _build(cfg, tp, ep, rank, tensors)
        out[f"captures.{name}"] = {}
        out[f"logits.{name}"] = prefill_logits(model, spec.pack, out[f"captures.{name}"])
        out[f"greedy.{name}"] = greedy(model, spec.prompts, spec.steps)
        if name == "tp":
            with unreduced_attention(model):
                out["control.unreduced_attention"] = prefill_logits(model, spec.pack)
        elif name == "ep":
            with patched_all(model.moe_layers(), "first_expert", 0):
                out["control.expert_ids_not_offset"] = prefill_logits(model, spec.pack)
        else:
            with bf16_reduce(model.comm):
                out["control.bf16_reduce"] = prefill_logits(model, spec.pack)
            out["state"] = {k: v.clone() for k, v in model.state_dict().items()}
            out["specs"] = {k: (s.source, s.dim, s.start, s.stop) for k, s in model.slice_specs.items()}
    return out


def _run_empty_rank(spec: SessionSpec, model: ParallelServingModel) -> dict[str, Any]:
    model.comm.calls.clear()
    out = {f"empty.{k}": v for k, v in empty_rank_step(model, spec.pack, spec.world).items()}
    out["empty.collectives"] = sum(model.comm.calls.values())
    with stale_partials(model):
        out["control.stale_partial"] = empty_rank_step(model, spec.pack, spec.world)["logits"]
    return out


def _run_shifted(spec: SessionSpec, cfg: ModelConfig, tensors: Tensors, model: ParallelServingModel
                 ) -> dict[str, Any]:
    """The asked layout's model reloaded mis-sliced (mis_sliced_read; its last use)."""
    load_rank(model, cfg, model.layout, tensors, read=mis_sliced_read(cfg, model.layout))
    for m in model.moe_layers():
        m.invalidate()
    return {"control.shifted_greedy": greedy(model, spec.prompts, spec.steps),
            "control.shifted_state": {k: v.clone() for k, v in model.state_dict().items()}}


def _run_bf16_moe(spec: SessionSpec, cfg: ModelConfig, rank: int, tensors: Tensors) -> dict[str, Any]:
    """The EP-only layout's MoE blocks in bf16 on dist_precision.moe_inputs, and the same with each rank's partial
    sum rounded to bf16 before the collective (the control)."""
    model = _build(cfg, 1, spec.world, rank, tensors, torch.bfloat16)
    inputs = moe_inputs(cfg.hidden_size, len(model.moe_layers()), spec.seed)
    out = {"moe_bf16": moe_outputs(model, inputs)}
    with partials_rounded(model.comm, torch.bfloat16):
        out["control.moe_bf16_rounded"] = moe_outputs(model, inputs)
    return out


def run_rank(rank: int, init_file: str, spec: SessionSpec) -> None:
    """One rank of the session (the function spawn_world starts in every process)."""
    torch.set_num_threads(1)
    cfg = ModelConfig.from_file(Path(spec.checkpoint_dir) / "config.json")
    world = init_world(ParallelLayout(spec.world, spec.world, rank), torch.device("cpu"), init_file)
    try:
        with CheckpointReader(spec.checkpoint_dir) as reader:
            tensors = normalize_hf_names(cfg, reader) if spec.names == "transformers" else reader
            models: dict[str, ParallelServingModel] = {}
            out = _run_layouts(spec, cfg, rank, tensors, models)
            if cfg.num_experts >= spec.world:  # on the asked layout when it splits experts, else on EP only
                out.update(_run_empty_rank(spec, models["asked" if spec.ep > 1 else "ep"]))
            out.update(_run_shifted(spec, cfg, tensors, models["asked"]))
            if cfg.num_experts >= spec.world:
                out.update(_run_bf16_moe(spec, cfg, rank, tensors))
        torch.save(out, Path(spec.out_dir) / f"rank{rank}.pt")
    finally:
        leave_world(world)


def run_session(spec_args: dict[str, Any]) -> list[dict[str, Any]]:
    """Spawn the world, run every rank, return each rank's results (rank order)."""
    with tempfile.TemporaryDirectory(prefix="k3v-dist-") as out_dir:
        spec = SessionSpec(out_dir=out_dir, **spec_args)
        spawn_world(run_rank, spec.world, spec)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(spec.world)]
