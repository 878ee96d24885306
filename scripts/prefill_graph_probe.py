"""How much of an eager prefill is host time? A one-sequence prefill replayed from a CUDA graph (diagnostic, CUDA).

The 1k prefill row and every served TTFT are host-bound on the H200: a 1 x 1024 prefill of kl-48b-8l takes ~29 ms
of wall time for ~11 ms of kernels and makes no host sync (scripts/prefill_diag.py, 2026-12-04). This script
measures the headroom a captured prefill would have, before anyone builds one: for each one-sequence length it
times model.prefill(pack) eagerly and replayed from a CUDA graph captured over the same pack (fla's dense
one-sequence chunk_kda call needs no host-side chunk list; a pack of several sequences would), and checks that the
replay's logits equal the eager call's bit for bit. A length whose capture fails is reported with the reason.
Nothing here is a serving path: a served prefill would need token-count buckets, padding sequences and fla's
`use_graph` varlen mode.

    python scripts/prefill_graph_probe.py [--preset kl-48b-8l] [--lengths 128,1024,8192]
"""

from __future__ import annotations

import argparse

import torch

from k3verify.bench.timing import cuda_time
from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.batch import PackedBatch
from k3verify.serving.graphs import cuda_graph_recorder
from k3verify.serving.model import ServingModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kl-48b-8l")
    ap.add_argument("--lengths", default="128,1024,8192")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_graph_probe.py needs CUDA (it captures CUDA graphs)")
    dev = torch.device("cuda")
    cfg = get_preset(a.preset)
    model = ServingModel(cfg, torch.bfloat16, dev).load(synthetic_tensors(cfg, 0, device=dev))
    print(f"{'tokens':>6s} {'eager ms':>9s} {'replay ms':>9s} {'ratio':>6s}  replay == eager")
    for T in (int(t) for t in a.lengths.split(",")):
        ids = torch.randint(0, cfg.vocab_size, (T,), device=dev, generator=torch.Generator(dev).manual_seed(T))
        pack = PackedBatch.build(ids, [T], device=dev)

        def step(pack: PackedBatch = pack) -> torch.Tensor:
            with torch.no_grad():
                return model.prefill(pack).logits

        eager_logits = step().clone()
        eager = cuda_time(step, warmup=2, repeats=7).median_s
        try:
            graph, out = cuda_graph_recorder(step)
        except Exception as exc:  # a kernel that syncs or allocates on the host in capture: say which
            print(f"{T:6d} {1e3 * eager:9.2f} {'-':>9s} {'-':>6s}  capture failed: {type(exc).__name__}: {exc}"[:300])
            continue
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(out, eager_logits)
        replay = cuda_time(graph.replay, warmup=2, repeats=7).median_s
        print(f"{T:6d} {1e3 * eager:9.2f} {1e3 * replay:9.2f} {eager / replay:5.2f}x  {same}")
        del graph, out


if __name__ == "__main__":
    main()
