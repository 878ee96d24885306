#!/usr/bin/env bash
# The GPU acceptance of issues #4 and #7, in device calls of at most 10 minutes each:
#   bash scripts/gpu_session.sh parity   cuda parity on k3-syn-25 (fla's Triton KDA as an extra reference,
#                                        CUDA-graph checks; FULL_S=seconds adds the full suite's bf16 checks)
#                                        + the gpu-marked tests, side by side
#   bash scripts/gpu_session.sh bench    k3verify bench on kl-48b-8l (parity in the same run, then speeds,
#                                        then a decode profile at batch 1 and 64)
#   bash scripts/gpu_session.sh plan     `k3verify plan --measure` on kl-48b-8l and k3-slice-4l: the planned
#                                        per-GPU memory against the measured CUDA peak of the same prefill
#                                        (passes within 10%); JSON under $OUT/plan-*.json
# Run back to back on a warm machine, the second call reuses Triton's on-disk compile/autotune cache.
# Wheels: scripts/fetch_gpu_wheels.sh here first, then carry .whl. Writes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/k3v-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>/dev/null || exit 2
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
step() { echo "== $1 ($(date +%T))"; }
quiet() { grep -v -E "Warning|warnings.warn|fast path refused|^\s*$"; }
case "${1:-}" in
parity)
    step "gpu tests (background) + cuda parity k3-syn-25"
    # tests/server needs fastapi/openai, which the GPU image lacks: collect only the GPU-bearing folders
    timeout "${PYTEST_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/oracle \
        tests/serving tests/bench >"$OUT/gpu-pytest.log" 2>&1 &
    start=$(date +%s)
    timeout "${PARITY_S:-300}" python3 -m k3verify parity --device cuda --preset k3-syn-25 \
        --report-dir "$OUT/parity-quick" 2>&1 | quiet | tail -30
    echo "parity (quick suite) wall: $(( $(date +%s) - start )) s"
    if [ -n "${FULL_S:-}" ]; then  # then the full suite (adds the bf16 module checks), on a warm Triton cache
        start=$(date +%s)
        timeout "$FULL_S" python3 -m k3verify parity --device cuda --preset k3-syn-25 --suite full \
            --report-dir "$OUT/parity-full" 2>&1 | quiet | tail -12
        echo "parity (full suite) wall: $(( $(date +%s) - start )) s"
    fi
    wait
    step "gpu tests"
    tail -15 "$OUT/gpu-pytest.log"
    ;;
bench)
    step "bench kl-48b-8l"
    timeout "${BENCH_S:-560}" python3 -m k3verify bench --preset kl-48b-8l --profile 1,64 \
        --json "$OUT/bench.json" 2>&1 >/dev/null | quiet | tail -80
    ;;
plan)
    rc=0
    for spec in "kl-48b-8l 16384 8192" "k3-slice-4l 8192 4096"; do
        set -- $spec
        step "plan vs measured: $1, context $2, segment $3"
        timeout "${PLAN_S:-200}" python3 -m k3verify plan --preset "$1" --gpus 1 --context "$2" --segment "$3" \
            --measure --json "$OUT/plan-$1.json" 2>&1 | quiet | tail -14
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
    echo "plan vs measured: $([ $rc -eq 0 ] && echo 'both within 10%' || echo 'NOT within 10% (see above)')"
    ;;
*)
    echo "usage: bash scripts/gpu_session.sh parity|bench|plan" >&2
    exit 2
    ;;
esac
step "done"
