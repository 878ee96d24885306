#!/usr/bin/env bash
# Everything the H200 must show, in one device call (the device tool allows ~10 minutes per command):
#   1. GPU tests (fla Triton routing, reference vs transformers+fla, Triton vs torch KDA);
#   2. cuda parity on k3-syn-25 (bf16, fla's Triton KDA as an extra reference, CUDA-graph checks);
#   3. the benchmark against transformers+fla on kl-48b-8l (parity in the same run, then speeds).
# Wheels: scripts/fetch_gpu_wheels.sh here first, then carry .whl. Usage on the device:
#   bash scripts/gpu_session.sh    (writes $OUT/gpu-pytest.log, $OUT/parity/, $OUT/bench.json)
set -uo pipefail
OUT=${OUT:-/tmp/k3v-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 2
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
step() { echo "== $1 ($(date +%T))"; }
step "gpu tests"
# tests/server needs fastapi/openai, which the GPU image lacks: collect only the GPU-bearing folders
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/oracle tests/serving tests/bench 2>&1 | tail -15 | tee "$OUT/gpu-pytest.log"
step "cuda parity k3-syn-25"
timeout 130 python3 -m k3verify parity --device cuda --preset k3-syn-25 --suite full --report-dir "$OUT/parity" \
    2>&1 | tail -25
step "bench kl-48b-8l"
timeout 330 python3 -m k3verify bench --preset kl-48b-8l --profile 1,64 --json "$OUT/bench.json" \
    2>&1 >/dev/null | tail -60
step "done"
