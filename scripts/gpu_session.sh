#!/usr/bin/env bash
# The GPU acceptance of issues #4 and #7, in device calls of at most 10 minutes each:
#   bash scripts/gpu_session.sh parity   cuda parity on k3-syn-25 (fla's Triton KDA as an extra reference,
#                                        CUDA-graph checks; FULL_S=seconds adds the full suite's bf16 checks)
#                                        + the gpu-marked tests, side by side
#   bash scripts/gpu_session.sh bench    k3verify bench on kl-48b-8l (parity in the same run, the served path
#                                        included, then speeds: prefill, decode, served under 1/16/64 streaming
#                                        clients, then a decode profile at batch 1 and 64) -> $OUT/bench.json;
#                                        then, in the time left, k3-slice-4l against the fp32 K3 reference gold
#                                        -> $OUT/bench-k3.json; prints both tables
#   bash scripts/gpu_session.sh bench-k3 the k3-slice-4l bench alone (when `bench` left it no time)
#   bash scripts/gpu_session.sh mutate-cuda   k3verify mutate --device cuda on the CUDA-path mutants (the
#                                        Triton kernels, fla flags, graph signature/padding, the engine step)
#   bash scripts/gpu_session.sh endpoint parity --endpoint self on cuda: our server (Triton/fla fast paths) over
#                                        HTTP against the oracle on the same GPU: kl-tiny bf16 and fp32, k3-syn-25
#                                        fp32; a table of every endpoint check at the end, reports under $OUT
# Run back to back on a warm machine, the second call reuses Triton's on-disk compile/autotune cache.
# Wheels: scripts/fetch_gpu_wheels.sh here first, then carry .whl. Writes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/k3v-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>/dev/null || exit 2
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
step() { echo "== $1 ($(date +%T))"; }
quiet() { grep -v -E "Warning|warnings.warn|fast path refused|^\s*$"; }
bench_k3() {  # k3-slice-4l against the fp32 K3 reference gold, within $1 seconds
    step "bench k3-slice-4l vs the fp32 K3 reference ($1 s)"
    timeout "$1" python3 -m k3verify bench --preset k3-slice-4l --prefill 1024 --profile 1 \
        --json "$OUT/bench-k3.json" 2>"$OUT/bench-k3.log" >/dev/null
    echo "k3-slice-4l bench exit $?"
}
show_bench() {  # the stage lines, parity, speeds and profile of each run, then the README tables
    for run in bench bench-k3; do
        [ -f "$OUT/$run.log" ] || continue
        step "$run"
        grep -E "^\[bench|^  (parity|prefill|decode|served|profile|kernel fallback)|^      " "$OUT/$run.log" \
            | quiet | tail -60
        [ -f "$OUT/$run.json" ] && python3 -m k3verify bench --table "$OUT/$run.json"
    done
}
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
    start=$(date +%s)
    step "bench kl-48b-8l (served 1,16,64; profile 1,64)"
    timeout "${BENCH_S:-500}" python3 -m k3verify bench --preset kl-48b-8l --profile 1,64 --served 1,16,64 \
        --json "$OUT/bench.json" 2>"$OUT/bench.log" >/dev/null
    echo "kl-48b-8l bench exit $? after $(( $(date +%s) - start )) s"
    left=$(( ${SESSION_S:-555} - ($(date +%s) - start) ))
    if [ "$left" -gt 90 ]; then bench_k3 "$left"; else echo "k3-slice-4l skipped (${left} s left): run bench-k3"; fi
    show_bench
    ;;
bench-k3)
    bench_k3 "${BENCH_S:-540}"
    show_bench
    ;;
mutate-cuda)
    step "k3verify mutate --device cuda (CUDA-path mutants)"
    timeout "${MUTATE_S:-540}" python3 -m k3verify mutate --device cuda --jobs "${JOBS:-4}" --timeout 300 \
        --report-dir "$OUT/mutate-cuda" --only 'kernel.fla.*' 'kernel.norm.triton*' 'kernel.conv.triton*' \
        'kernel.router.triton*' 'serving.graph.*' 'serving.step.*' 'serving.sched.*' 2>&1 | quiet | tail -40
    ;;
endpoint)
    for run in kl-tiny:bfloat16 kl-tiny:float32 k3-syn-25:float32; do
        preset=${run%%:*} dtype=${run##*:}
        step "parity --endpoint self --device cuda --preset $preset --dtype $dtype"
        timeout "${ENDPOINT_S:-180}" python3 -m k3verify parity --endpoint self --device cuda --preset "$preset" \
            --dtype "$dtype" --report-dir "$OUT/endpoint-$preset-$dtype" 2>&1 | quiet | tail -3
    done
    python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print(f"{'run':24} {'check':28} {'status':8} {'metric':>10} {'bar':>10} {'control':>8}  note")
for report in sorted(Path(sys.argv[1]).glob("endpoint-*/report.json")):
    for r in json.loads(report.read_text())["results"]:
        metric = "-" if r["metric"] is None else f"{float(r['metric']):.3g}"
        bar = "-" if r["bar"] is None else f"{float(r['bar']):.3g}"
        control = (r.get("control") or {}).get("status", "-")
        note = (r["reason"] or (r["notes"] or [""])[0])[:70]
        print(f"{report.parent.name[9:]:24} {r['id']:28} {r['status']:8} {metric:>10} {bar:>10} {control:>8}  {note}")
PY
    ;;
*)
    echo "usage: bash scripts/gpu_session.sh parity|bench|bench-k3|mutate-cuda|endpoint" >&2
    exit 2
    ;;
esac
step "done"
