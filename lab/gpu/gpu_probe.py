"""One-shot GPU environment probe + baseline timing (run on the lent H200)."""

from __future__ import annotations

import inspect
import json
import os
import time

import torch

from k3verify.bench.floor import measure_copy_bandwidth
from k3verify.bench.timing import cuda_time, random_prompt
from k3verify.oracle.hf_model import build_hf_model, fill_random
from k3verify.presets import preset_hf_config


def main() -> None:
    out: dict[str, object] = {}
    dev = torch.device("cuda")
    out["torch"] = torch.__version__
    out["gpu"] = torch.cuda.get_device_name()
    import fla
    import transformers
    import triton

    out["fla"], out["transformers"], out["triton"] = fla.__version__, transformers.__version__, triton.__version__
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    out["chunk_kda_params"] = list(inspect.signature(chunk_kda).parameters)
    out["fused_recurrent_kda_params"] = list(inspect.signature(fused_recurrent_kda).parameters)
    out["grouped_mm"] = hasattr(torch, "_grouped_mm")
    bw = measure_copy_bandwidth(dev)
    out["copy_GBps"] = bw / 1e9
    t0 = time.time()
    model = build_hf_model(preset_hf_config(os.environ.get("PRESET", "kl-48b-8l")), dev)
    fill_random(model)
    torch.cuda.synchronize()
    out["build_s"] = time.time() - t0
    mods = __import__("transformers.models.kimi_linear.modeling_kimi_linear", fromlist=["x"])
    out["hf_chunk_impl"] = getattr(mods.chunk_kimi_delta_attention, "__module__", "?")
    with torch.no_grad():
        for T in (1024, 8192):
            ids = random_prompt(1, T, 163840, 1, dev)
            t = cuda_time(lambda ids=ids: model(input_ids=ids, use_cache=False), warmup=1, repeats=3)
            out[f"hf_prefill_{T}_tok_s"] = T / t.median_s
        for B in (1, 16, 64):
            ids = random_prompt(B, 128, 163840, 2, dev)
            gen = lambda ids=ids: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,  # noqa: E731
                                         min_new_tokens=64, do_sample=False, pad_token_id=0)
            t = cuda_time(gen, warmup=1, repeats=2)
            out[f"hf_generate_b{B}_tok_s"] = B * 64 / t.median_s
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
