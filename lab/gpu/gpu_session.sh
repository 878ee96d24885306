#!/usr/bin/env bash
# GPU lab cases, each sized for one device call of at most 10 minutes; run from the repository root:
#   bash lab/gpu/gpu_session.sh parity   cuda parity on k3-syn-25 (fla's Triton KDA as an extra reference,
#                                        CUDA-graph checks; FULL_S=seconds adds the full suite's bf16 checks)
#                                        + the gpu-marked tests, side by side
#   bash lab/gpu/gpu_session.sh noise    the noise-barred checks measured on cuda (table + $OUT/noise-cuda.json),
#                                        then the full cuda suite on k3-syn-25 with bars derived at run time
#   bash lab/gpu/gpu_session.sh bench    k3verify bench on kl-48b-8l (parity in the same run, the served path
#                                        included, then speeds: prefill, decode, served under 1/16/64 streaming
#                                        clients, then a decode profile at batch 1 and 64) -> $OUT/bench.json;
#                                        then, in the time left, k3-slice-4l against the fp32 K3 reference gold
#                                        -> $OUT/bench-k3.json; prints both tables
#   bash lab/gpu/gpu_session.sh bench-k3 the k3-slice-4l bench alone (when `bench` left it no time)
#   bash lab/gpu/gpu_session.sh prefill  the Triton prefill conv: its gpu test, CUDA checks kernel.conv.* and
#                                        kernel.kda.* (fla's varlen and one-sequence dense chunk_kda calls),
#                                        lab/gpu/prefill_diag.py (host time and syncs), the kl-48b-8l bench
#   bash lab/gpu/gpu_session.sh moe      the MoE kernels: gpu tests, (MICRO=1) the per-layer microbenchmark, CUDA checks
#                                        kernel.moe/conv/kda.* (k3-syn-25), the kl-48b-8l bench, then mutate-moe
#   bash lab/gpu/gpu_session.sh engine   where a served engine step's time goes (lab/gpu/engine_step_diag.py) and the MoE
#                                        combine at 1/2/4 tokens
#   bash lab/gpu/gpu_session.sh mutate-cuda   k3verify mutate --device cuda on the CUDA-path mutants (the
#                                        Triton kernels, fla flags, graph signature/padding, the engine step)
#   bash lab/gpu/gpu_session.sh plan     `k3verify plan --measure` on kl-48b-8l and k3-slice-4l: the planned
#                                        per-GPU memory against the measured CUDA peak of the same prefill
#                                        (passes within 10%); JSON under $OUT/plan-*.json
#   bash lab/gpu/gpu_session.sh mxfp4    the packed MXFP4 experts: CUDA checks kernel.mxfp4.* and moe.module.packed
#                                        on k3-syn-25 + their gpu-marked tests, then `k3verify bench --mxfp4`
#                                        on k3-slice-4l (packed vs dequantized; its table last). ~3 min cold, most
#                                        of it the first bf16 prefill's Triton compiles + fla autotuning
#   bash lab/gpu/gpu_session.sh spec     speculative decoding on kl-48b-8l: its parity (score logits vs the fp32
#                                        gold, fused vs unfused KDA score bit for bit at rows 1/4/8 eager + graph,
#                                        score graph vs eager), then plain vs speculative tok/s at batch 1 and 16,
#                                        k=4, acceptance 0/50/80% (the controlled drafter's reference first
#                                        iterated untimed to the speculative path's own continuation; each row
#                                        says whether it converged), and the per-KDA-layer score cost; then the
#                                        CUDA-only spec.* checks on k3-syn-25 and the gpu test of the fused KDA
#                                        score; a table of every row, $OUT/spec-summary.json (~180 s cold)
#   bash lab/gpu/gpu_session.sh realsize checkpoint make kl-48b-8l (27.7 GB on disk) -> digest -> parity
#                                        --checkpoint --device cuda -> serve answering one request (budgets
#                                        MAKE_S=100 DIGEST_S=40 PARITY_S=340 SERVE_S=150 (serve warms up first); measured on a cold
#                                        H200: 49 s, 7 s, 300 s, 35 s)
#   bash lab/gpu/gpu_session.sh types    the CUDA fast-path checks of
#                                        serving_fastpath_kernels.py (kernel.norm/router/attn.sdpa) and weights.*
#                                        on k3-syn-25, the gpu-marked norm/router tests, then `bench --checkpoint`
#                                        on the kl-tiny cache dir (the resolver end to end); a table at the end,
#                                        $OUT/types.json. ~2 min
#   bash lab/gpu/gpu_session.sh invariance  seeded-request batch invariance on cuda (k3-tiny; eager and
#                                        graph decode, fp32 and bf16) -> table + $OUT/invariance.json
#   bash lab/gpu/gpu_session.sh round    invariance + the served engine's CUDA checks + the gpu test that a decode
#                                        launch never syncs (<= 8 min cold), logs under $OUT as they run; then
#                                        `spec` (SPEC_S=420) and `mxfp4` as calls of their own
#   bash lab/gpu/gpu_session.sh endpoint parity --endpoint self on cuda: our server (Triton/fla fast paths) over
#                                        HTTP against the oracle on the same GPU: kl-tiny bf16 and fp32, k3-syn-25
#                                        fp32; a table of every endpoint check at the end, reports under $OUT
#   bash lab/gpu/gpu_session.sh tail     the grouped MoE combine's Triton tail: gpu test, CUDA checks kernel.moe.* moe.module.*
#   bash lab/gpu/gpu_session.sh spec-round  a batch-1 speculative round's host time by piece beside the score's device
#                                        time (lab/gpu/spec_round_diag.py), unfused and fused
#   bash lab/gpu/gpu_session.sh diag     three host/kernel diagnostics in one call: a 1k prefill's host time
#                                        (prefill_diag.py), the MoE decode kernels at 64 tokens with skewed routing
#                                        (moe_decode_bench.py, the expert list alone among its columns), a batch-1
#                                        speculative round and the offline loop under cProfile (spec_round_diag.py)
#   bash lab/gpu/gpu_session.sh kda-decode-tune  launch configurations of fla's KDA decode recurrence at batch 1/16/64
#                                        (lab/gpu/kda_decode_tune.py), then the batch-1 speculative round by piece
#   bash lab/gpu/gpu_session.sh long-context  32k/128k prefill, peak vs plan, decode at context, parity at 32k
#   bash lab/gpu/gpu_session.sh spec-b1  the spec bench's speed rows alone (SPEC_BATCH, default 1; parity as in `spec`),
#                                        fused KDA score -> $OUT/spec-b$SPEC_BATCH.json and its table
#   bash lab/gpu/gpu_session.sh prefill-graph  the served prefill eager vs replayed from a CUDA graph per pack (PACKS),
#                                        replay == static step, then the prefill-graph GPU tests and gate checks
#                                        (PG_MUTANT=1: and the CUDA mutant; PREFILL_GRAPHS=1 bench: the bench with them on)
#   bash lab/gpu/gpu_session.sh served-profile  the served engine's step breakdown and where the engine thread's time
#                                        goes under 64 and 16 streaming clients (lab/gpu/served_profile.py; PROBE)
#   bash lab/gpu/gpu_session.sh gemm         the eager decode step's GEMMs by shape vs the bytes they read (BATCH)
#   bash lab/gpu/gpu_session.sh score-tune  launch configurations of the Triton KDA score kernels, timed, bits held
#   bash lab/gpu/gpu_session.sh sdpa         fused SDPA's host time per backend at MLA prefill shapes
#   bash lab/gpu/gpu_session.sh decode-fusions  the batch-1 decode fusions' CUDA checks (in-kernel KDA gate, residual add
#                                        in the norm) and their CUDA mutants (THEN=bench to measure the step)
#   bash lab/gpu/gpu_session.sh mutate-moe   the CUDA mutants of the MoE decode kernels and the conv prefill (MUTANTS_S)
# THEN="case ..." runs more cases after any case, in the same call (one Triton cache restore and save).
# Run back to back on a warm machine, the second call reuses Triton's on-disk compile/autotune cache; on a cold one,
# carry .tcache/ (the previous call's $OUT/tcache.tgz.* copied there): a cold `moe` call took 168 s with it
# where the same work had run out of 600 s without. .whl + .tcache + the tree must stay under 64 MiB.
# Wheels: lab/gpu/fetch_gpu_wheels.sh here first, then carry .whl. Writes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/k3v-gpu}
mkdir -p "$OUT"
# once per call: a case that runs another case (round -> invariance) finds the wheels already in place
if [ -z "${K3V_SITE_READY:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>/dev/null || exit 2
    export K3V_SITE_READY=1
fi
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
# Triton's on-disk cache (compiled kernels, and fla's autotune picks with TRITON_CACHE_AUTOTUNING) travels
# between calls: restored from .tcache/ (carry it) at the start, saved as $OUT/tcache.txz.* (xz, 15 MB parts) at
# the end; copy those parts into .tcache/ here for the next call (xz: 428 MB of cache in ~28 MB where gzip took
# 65, which came back only in part: a call returns at most 8 files and 64 MB). A cold machine otherwise spends
# ~180 s compiling. Everything else under $OUT but x.out and the top-level JSON goes into $OUT/logs.tgz on exit,
# for the same 8-file limit.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache} TRITON_CACHE_AUTOTUNING=1
on_exit() {
    [ "${TCACHE_SAVE:-1}" = 0 ] || save_tcache
    bundle_logs
}
save_tcache() {
    rm -f "$OUT"/tcache.t?z.*
    if command -v xz >/dev/null; then
        tar -cf - -C "$TRITON_CACHE_DIR" . 2>/dev/null | xz -T0 -6 | split -b 15M - "$OUT/tcache.txz."
    else
        tar -cf - -C "$TRITON_CACHE_DIR" . 2>/dev/null | python3 -c "import lzma, shutil, sys
with lzma.open(sys.stdout.buffer, 'wb', preset=3) as out: shutil.copyfileobj(sys.stdin.buffer, out)" | split -b 15M - "$OUT/tcache.txz."
    fi
    echo "triton cache saved: $(du -sh "$TRITON_CACHE_DIR" | cut -f1) -> $(cat "$OUT"/tcache.txz.* | wc -c) bytes"
}
bundle_logs() {
    (cd "$OUT" && ls -A | grep -vE '^(\.bundle|x\.out|tcache\.txz\..*|logs\.tgz|parts\.tgz|[^/]*\.json)$' >"$OUT/.bundle" || true
     if [ -s "$OUT/.bundle" ]; then tar -czf logs.tgz -T .bundle && xargs -d '\n' rm -rf <.bundle; fi
     rm -f .bundle)
}
if [ -z "${K3V_TCACHE_READY:-}" ]; then  # the outermost case only: restore once, save on exit
    export K3V_TCACHE_READY=1
    mkdir -p "$TRITON_CACHE_DIR"
    if ls .tcache/tcache.txz.* >/dev/null 2>&1; then  # xz (lab/gpu/tcache_repack.sh): less than half the size
        cat .tcache/tcache.txz.* | python3 -c "import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1], filter='fully_trusted')" \
            "$TRITON_CACHE_DIR" && echo "triton cache restored: $(du -sh "$TRITON_CACHE_DIR" | cut -f1)"
    elif ls .tcache/tcache.tgz.* >/dev/null 2>&1; then
        cat .tcache/tcache.tgz.* | tar -xzf - -C "$TRITON_CACHE_DIR" \
            && echo "triton cache restored: $(du -sh "$TRITON_CACHE_DIR" | cut -f1)"
    fi
    trap on_exit EXIT  # TCACHE_SAVE=0: a short call that keeps the carried one (the logs are bundled still)
fi
step() { echo "== $1 ($(date +%T))"; }
quiet() { grep -v -E "Warning|warnings.warn|fast path refused|^\s*$"; }
bench_k3() {  # k3-slice-4l against the fp32 K3 reference gold, within $1 seconds
    step "bench k3-slice-4l vs the fp32 K3 reference ($1 s)"
    timeout "$1" python3 -m k3verify bench --preset k3-slice-4l --prefill 1024 --profile 1 ${PREFILL_GRAPHS:+--prefill-graphs} \
        --json "$OUT/bench-k3.json" 2>"$OUT/bench-k3.log" >/dev/null
    echo "k3-slice-4l bench exit $?"
}
show_bench() {  # the stage lines, parity, speeds and profile of each run, then the README tables
    for run in bench bench-k3; do
        [ -f "$OUT/$run.log" ] || continue
        step "$run"
        grep -E "^\[bench|^  (parity|prefill|decode|served|profile|kernel fallback)|^      " "$OUT/$run.log" \
            | quiet | tail -60
        if grep -q "^Traceback" "$OUT/$run.log"; then  # a crash: its exception, which the grep above drops
            echo "-- $run raised:"; sed -n '/^Traceback/,$p' "$OUT/$run.log" | quiet | tail -25
        fi
        [ -f "$OUT/$run.json" ] && python3 -m k3verify bench --table "$OUT/$run.json"
    done
}
case "${1:-}" in
parity)
    step "gpu tests (background) + cuda parity k3-syn-25"
    # tests/api needs fastapi/openai, which the GPU image lacks: collect only the GPU-bearing folders
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
noise)
    # Every noise-barred check measured on the GPU (the recording is CPU-only, so CUDA runs
    # derive their bars at run time); the table shows noise, bar, this run's metric and margin per check, and
    # $OUT/noise-cuda.json holds it (not committed). Then the full cuda suite on k3-syn-25 with those bars.
    step "noise-barred checks on cuda (k3-tiny, k3-syn-25)"
    timeout "${NOISE_S:-300}" python3 tools/measure_noise.py --device cuda --preset k3-tiny --preset k3-syn-25 \
        --out "$OUT/noise-cuda.json" 2>&1 | quiet | tail -40
    step "cuda parity k3-syn-25, full suite (bars from noise measured at run time)"
    start=$(date +%s)
    timeout "${FULL_S:-280}" python3 -m k3verify parity --device cuda --preset k3-syn-25 --suite full \
        --report-dir "$OUT/parity-full" 2>&1 | quiet | tail -12
    echo "parity (full suite) wall: $(( $(date +%s) - start )) s"
    ;;
bench)
    start=$(date +%s)
    step "bench kl-48b-8l (served 1,16,64; profile decode 1,64, prefill 1k,8k)"
    timeout "${BENCH_S:-500}" python3 -m k3verify bench --preset kl-48b-8l --profile 1,64 --profile-prefill 1024,8192 --served 1,16,64 \
        ${PREFILL_GRAPHS:+--prefill-graphs} --json "$OUT/bench.json" 2>"$OUT/bench.log" >/dev/null
    echo "kl-48b-8l bench exit $? after $(( $(date +%s) - start )) s"
    left=$(( ${SESSION_S:-555} - ($(date +%s) - start) ))
    if [ "$left" -gt 90 ]; then bench_k3 "$left"; else echo "k3-slice-4l skipped (${left} s left): run bench-k3"; fi
    show_bench
    ;;
bench-k3)
    bench_k3 "${BENCH_S:-540}"
    show_bench
    ;;
prefill)
    # The Triton prefill conv round (one call, ~8 min cold): its gpu test and the CUDA conv checks on k3-syn-25,
    # the prefill host-time / sync diagnosis, then the kl-48b-8l bench (no k3 slice; its cold fp32 gold alone took
    # 180 s on 2026-12-01). The conv mutants run in `mutate-cuda` (pattern kernel.conv.triton*).
    step "conv prefill: gpu test + cuda checks kernel.conv.* kernel.kda.* (k3-syn-25)"
    timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kernels_conv_prefill.py 2>&1 | tail -2
    timeout 150 python3 -m k3verify parity --device cuda --preset k3-syn-25 --only 'kernel.conv.*' \
        --only 'kernel.kda.*' --report-dir "$OUT/parity-conv" 2>&1 | quiet | grep -E "conv|kda|PASS|FAIL"
    step "prefill host time and host syncs (kl-48b-8l)"
    timeout 100 python3 -m lab.gpu.prefill_diag --shapes 1x1024,64x128,1x8192 --top 12 >"$OUT/diag.log" 2>&1
    grep -A4 "^shape" "$OUT/diag.log"; grep "sync sites" "$OUT/diag.log"
    SESSION_S=0 BENCH_S=${BENCH_S:-420} bash "$0" bench
    ;;
moe)
    # The MoE decode kernels (one call, ~6 min on a carried Triton cache): their gpu test and the conv prefill's,
    # the per-layer microbenchmark (tile choices against the grouped GEMMs), the CUDA checks kernel.moe.*,
    # kernel.conv.*, kernel.kda.* on k3-syn-25, then the kl-48b-8l bench (no k3 slice)
    step "gpu tests: MoE decode kernels, the grouped combine's tail, conv prefill"
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kernels_moe_decode.py \
        tests/kernels/test_kernels_moe_tail.py tests/kernels/test_kernels_conv_prefill.py 2>&1 | tail -3
    if [ -n "${MICRO:-}" ]; then
        step "MoE combine per layer, kl-48b shapes"
        timeout 90 python3 -m lab.gpu.moe_decode_bench 2>&1 | quiet | tail -8
    fi
    step "cuda checks kernel.moe.* kernel.conv.* kernel.kda.* (k3-syn-25)"
    timeout 150 python3 -m k3verify parity --device cuda --preset k3-syn-25 --only 'kernel.moe.*' \
        --only 'kernel.conv.*' --only 'kernel.kda.*' --report-dir "$OUT/parity-kernels" 2>&1 | quiet | tail -14
    SESSION_S=0 BENCH_S=${BENCH_S:-300} THEN= bash "$0" bench
    THEN= bash "$0" mutate-moe
    ;;
tail)
    # The grouped MoE combine's Triton tail: its gpu test and the CUDA checks of the MoE combine and module
    step "gpu test: the grouped combine's tail; cuda checks kernel.moe.* moe.module.* (k3-syn-25)"
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kernels_moe_tail.py 2>&1 | tail -3
    timeout 120 python3 -m k3verify parity --device cuda --preset k3-syn-25 --only 'kernel.moe.*' --only 'moe.module.*' \
        --report-dir "$OUT/parity-moe" 2>&1 | quiet | tail -12
    ;;
spec-round)
    # Where a batch-1 speculative round's time goes (lab/gpu/spec_round_diag.py): host time of drafting, score
    # launch, readback, acceptance and commit beside the score's device time, unfused and fused KDA score
    for fused in "" "--fused"; do
        step "speculative round at batch 1 (kl-48b-8l) ${fused:-unfused}"
        timeout "${DIAG_S:-120}" python3 -m lab.gpu.spec_round_diag $fused 2>&1 | quiet | tail -9
    done
    ;;
diag)
    step "prefill host time (kl-48b-8l, 1 x 1024)"
    timeout "${DIAG_S:-100}" python3 -m lab.gpu.prefill_diag --shapes 1x1024 --top "${TOP:-30}" 2>&1 | quiet
    step "MoE decode kernels, 64 tokens, skewed routing"
    timeout 90 python3 -m lab.gpu.moe_decode_bench --tokens 64 --skew 1 2>&1 | quiet | tail -12
    step "speculative round at batch 1 (kl-48b-8l), fused, and the offline loop profiled"
    timeout "${DIAG_S:-150}" python3 -m lab.gpu.spec_round_diag --fused --profile "${TOP:-30}" 2>&1 | quiet
    ;;
prefill-graph)
    # Prefill through CUDA graphs: the probe (eager vs replay per pack, replay == static bits, RMS vs eager), the GPU
    # tests, the gate checks on k3-tiny (kernel.kda.triton_vs_torch holds fla's use_graph mode) and the CUDA mutant
    step "prefill eager vs CUDA-graph replay (kl-48b-8l; served path, serving/prefill_graphs.py)"
    timeout "${DIAG_S:-200}" python3 -m lab.gpu.prefill_graph_probe ${PACKS:+--packs "$PACKS"} 2>&1 | quiet
    step "prefill-graph GPU tests and gate checks"
    timeout 120 python3 -m pytest -q -m gpu tests/serving/test_prefill_graphs_cuda.py 2>&1 | tail -5
    timeout 120 python3 -m k3verify parity --device cuda --preset k3-tiny --only 'serving.prefill_graph.*' \
        --only kernel.kda.triton_vs_torch --report-dir "$OUT/prefill-graph-gates" 2>&1 | quiet | tail -4
    if [ -n "${PG_MUTANT:-}" ]; then  # the CUDA mutant of the static KDA prefill (~60-140 s): a call of its own
        timeout 150 python3 -m k3verify mutate --device cuda --jobs 2 --timeout 140 --report-dir "$OUT/mutate-pg" \
            --only kernel.fla.static_pack_without_offsets 2>&1 | quiet | tail -4
    fi
    ;;
long-context)
    # One prompt of 32k and 128k tokens prefilled in the engine's 8k segments: tok/s, CUDA peak vs plan (10%),
    # decode step at that context vs the floor, parity vs the fp32 serving path at 32k (bar: 2x the 1k drift)
    step "long context ${LC_PRESET:-kl-48b-8l}: ${CONTEXTS:-32768,131072}"
    timeout "${LC_S:-420}" python3 -m lab.gpu.long_context --preset "${LC_PRESET:-kl-48b-8l}" \
        --contexts "${CONTEXTS:-32768,131072}" --parity "${PARITY_AT:-32768}" --parity-base 1024 \
        --json "$OUT/long-context-${LC_PRESET:-kl-48b-8l}.json" 2>&1 | quiet | tail -14
    ;;
spec-b1)
    b=${SPEC_BATCH:-1}
    step "spec bench kl-48b-8l, batch $b, acceptance 0/50/80%, fused KDA score"
    timeout "${SPEC_S:-300}" python3 -m k3verify bench --preset kl-48b-8l --speculative controlled --num-draft 4 \
        --batch "$b" --spec-accept 0,0.5,0.8 --kda-fused-score --json "$OUT/spec-b${b//,/-}.json" \
        2>"$OUT/spec-b${b//,/-}.log" >/dev/null
    echo "spec bench exit $?"
    [ -f "$OUT/spec-b${b//,/-}.json" ] && python3 -m k3verify bench --table "$OUT/spec-b${b//,/-}.json"
    ;;
kda-decode-tune)  # TUNE=0: the speculative round alone
    if [ "${TUNE:-1}" != 0 ]; then
        step "fla's KDA decode recurrence, launch configurations (kl-48b-8l, one layer)"
        timeout "${DIAG_S:-120}" python3 -m lab.gpu.kda_decode_tune 2>&1 | quiet
    fi
    step "speculative round at batch 1 (kl-48b-8l), fused"
    timeout "${DIAG_S:-150}" python3 -m lab.gpu.spec_round_diag --fused --converge 10 2>&1 | quiet
    ;;
gemm)
    # The eager decode step's matmuls grouped by input shape: us per call against the weight bytes each reads
    for b in ${BATCH:-1 64}; do
        step "GEMMs of a decode step by shape (kl-48b-8l, batch $b)"
        timeout "${DIAG_S:-120}" python3 -m lab.gpu.gemm_profile --batch "$b" 2>&1 | quiet | tail -"${TAIL:-24}"
    done
    ;;
score-tune)
    # Launch configurations of the Triton KDA score kernels (value block, warps, register cap), each held to the
    # shipped launch bit for bit, microseconds per call at 1-16 rows (lab/gpu/score_tune.py)
    step "KDA score launches (kl-48b-8l, one layer)"
    timeout "${DIAG_S:-240}" python3 -m lab.gpu.score_tune --rows "${ROWS:-1,2,4,8,16}" 2>&1 | quiet | tail -"${TAIL:-75}"
    ;;
mutate-moe)
    step "CUDA mutants of the MoE decode kernels and the conv prefill (${MUTANTS_S:-150} s)"
    set -f  # MUTANTS_ONLY: patterns, not file globs
    timeout "${MUTANTS_S:-150}" python3 -m k3verify mutate --device cuda --jobs 4 --timeout 140 \
        --report-dir "$OUT/mutate-moe" --only ${MUTANTS_ONLY:-kernel.moe.decode* kernel.moe.tail* kernel.conv.triton_prefill*} \
        2>&1 | quiet | tail -12
    set +f
    ;;
sdpa)
    # How long fused SDPA holds the host per backend at the MLA prefill shapes (lab/gpu/sdpa_probe.py)
    step "SDPA host time per backend (kl-48b-8l MLA heads)"
    timeout "${DIAG_S:-150}" python3 -m lab.gpu.sdpa_probe 2>&1 | quiet | tail -30
    ;;
engine)
    # Where a served engine step's time goes (lab/gpu/engine_step_diag.py: the bare prefill, the runner's, a whole
    # launcher step with prefill, decode-only and mixed, each timed alone with its host syncs and MoE paths),
    # the MoE combine at 1, 2 and 4 tokens (the compact grid's crossover)
    step "engine step pieces (kl-48b-8l: 32 prompts x 128 tokens beside 64 running rows)"
    timeout "${DIAG_S:-150}" python3 -m lab.gpu.engine_step_diag --prompts 32 --running 64 >"$OUT/engine-diag.log" 2>&1
    echo "engine_step_diag exit $?"; grep -E "^=====" "$OUT/engine-diag.log"; tail -9 "$OUT/engine-diag.log"
    step "MoE combine per layer at 1, 2, 4 tokens"
    timeout 90 python3 -m lab.gpu.moe_decode_bench --tokens 1,2,4 2>&1 | quiet | tail -5
    ;;
served-profile)
    # Where the served engine's host time goes under streaming clients (lab/gpu/served_profile.py): the step
    # breakdown and the engine thread's sampled stack, at concurrency 64 then 16 (C="64 16"); PROBE="calls spin"
    # lists the C calls that held the engine thread instead (spin: with the GPU kept behind)
    for c in ${C:-64 16}; do
        for probe in ${PROBE:-sampler}; do
            step "served profile, $c streaming clients (kl-48b-8l), probe $probe"
            timeout "${DIAG_S:-150}" python3 -m lab.gpu.served_profile --concurrency "$c" --top 28 --probe "$probe" \
                2>&1 | quiet | tail -75
        done
    done
    ;;
decode-fusions)
    # The batch-1 decode fusions: fla's in-kernel forget gate and beta sigmoid
    # (kernel.kda.decode_gated_triton), the residual add inside the RMSNorm (kernel.norm.add_rms_triton), the MoE
    # decode finish with the shared expert added (kernel.moe.decode_vs_torch); then their CUDA mutants.
    # THEN=bench measures the step.
    # kl-tiny: a k3-syn-25 run of these checks (kda.* module checks included) found no end in 150 s on a cold machine
    step "cuda checks kernel.kda.* kernel.norm.* kernel.moe.* (kl-tiny)"
    timeout "${CHECKS_S:-200}" python3 -m k3verify parity --device cuda --preset kl-tiny --only 'kernel.kda.*' \
        --only 'kernel.norm.*' --only 'kernel.moe.*' --report-dir "$OUT/parity-fusions" >"$OUT/checks.log" 2>&1
    echo "cuda checks exit $?"; grep -E "kernel\.|PASS|FAIL" "$OUT/checks.log" | quiet | tail -24
    MUTANTS=${MUTANTS:-"kernel.fla.decode_gated* kernel.norm.add_rms* kernel.moe.decode_shared* kernel.moe.decode_finish*"} \
        MUTATE_S=${MUTATE_S:-240} JOBS=${JOBS:-6} THEN= bash "$0" mutate-cuda
    ;;
mutate-cuda)
    step "k3verify mutate --device cuda (CUDA-path mutants)"
    # MUTANTS="pattern ..." runs a subset (e.g. MUTANTS="kernel.attn.* serving.graph.*" after a change there)
    set -f  # the patterns reach mutate unexpanded
    timeout "${MUTATE_S:-540}" python3 -m k3verify mutate --device cuda --jobs "${JOBS:-4}" --timeout "${MUTANT_S:-300}" \
        --report-dir "$OUT/mutate-cuda" --only ${MUTANTS:-'kernel.fla.*' 'kernel.norm.triton*' 'kernel.conv.triton*' \
        'kernel.router.triton*' 'kernel.mxfp4.triton*' 'kernel.moe.decode*' 'kernel.moe.tail*' 'kernel.attn.*' 'serving.graph.*' \
        'serving.step.*' 'serving.sched.*'} 2>&1 | quiet | tail -40
    set +f
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
mxfp4)
    step "cuda checks kernel.mxfp4.* + moe.module.packed (k3-syn-25), then the gpu tests of the packed path"
    timeout "${PARITY_S:-45}" python3 -m k3verify parity --device cuda --preset k3-syn-25 --only 'kernel.mxfp4.*' \
        --only moe.module.packed --report-dir "$OUT/parity-mxfp4" 2>&1 | quiet | tail -12
    timeout "${PYTEST_S:-30}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kernels_mxfp4_grouped.py \
        2>&1 | tail -3
    step "bench --mxfp4 k3-slice-4l"
    timeout "${BENCH_S:-180}" python3 -m k3verify bench --mxfp4 --json "$OUT/bench-mxfp4.json" 2>&1 >/dev/null \
        | quiet | tail -40
    ;;
spec)
    # The bench gets SPEC_S (420): on 2026-12-01 a cold H200 ran out of 270 in the transformers+fla gold (181 s of
    # Triton compiles and fla autotuning), the same bench took 36 s warm; the controlled drafter's untimed
    # reference iteration adds up to new_tokens=64 speculative runs per acceptance level (~0.3 s each at batch 1,
    # ~0.6 s at 16; a handful when it converges fast). Then the CUDA-only spec.* checks on k3-syn-25 get what is
    # left of SPEC_TOTAL_S (480), at least 45 s (they took 17 s that day), with the gpu test beside them
    start=$(date +%s)
    step "spec bench kl-48b-8l (fused KDA score for the speed rows; ${SPEC_S:-420} s)"
    timeout "${SPEC_S:-420}" python3 -m k3verify bench --preset kl-48b-8l --speculative controlled --num-draft 4 \
        --batch 1,16 --spec-accept 0,0.5,0.8 --kda-fused-score --json "$OUT/spec.json" 2>"$OUT/spec.log" >/dev/null
    echo "spec bench exit $? after $(( $(date +%s) - start )) s"
    grep -E "^\[bench|^  parity" "$OUT/spec.log" | quiet | tail -30
    left=$(( ${SPEC_TOTAL_S:-480} - ($(date +%s) - start) ))
    [ "$left" -lt 45 ] && left=45
    step "spec.* CUDA checks on k3-syn-25 (${left} s) + the gpu test of the fused KDA score"
    timeout "${SPEC_TEST_S:-40}" python3 -m pytest -q -rA --tb=short -m gpu -p no:cacheprovider \
        tests/kernels/test_kernels_kda_score.py >"$OUT/spec-pytest.log" 2>&1 &
    timeout "$left" python3 -m k3verify parity --device cuda --preset k3-syn-25 --only spec.fused.vs_unfused \
        --only spec.kernel.triton_vs_torch --only spec.verify.graph_vs_eager --report-dir "$OUT/parity-spec" \
        >"$OUT/parity-spec.log" 2>&1
    echo "spec checks exit $? after $(( $(date +%s) - start )) s"
    wait
    tail -30 "$OUT/spec-pytest.log"  # -rA --tb=short: a failure shows its reason
    step "spec table"
    python3 -m lab.gpu.gpu_spec_summary "$OUT"
    ;;
realsize)
    # kl-48b-8l (27.7 GB bf16) made on disk, digested, gated by parity --device cuda (layer-by-layer module
    # checks, model-level vs a transformers fp32 gold) and served, one budget per step; prints a table with
    # each step's wall time and peak GPU memory, writes $OUT/realsize.json (the checkpoint stays in /tmp)
    # in four parts, two per call (about 280 s each on a warm Triton cache): call it twice on the same warm machine;
    # the second call reuses the checkpoint and the first two parts, merges the four and serves from the merged report.
    # Each finished part comes back in $OUT/parts.tgz: `tar -xzf parts.tgz -C .realsize-parts` here and carry
    # .realsize-parts, and a call on a fresh machine runs only the parts still missing (same package source and card)
    step "realsize kl-48b-8l: make -> digest -> parity (parts ${PARTS:-4}, ${PARTS_PER_CALL:-2} per call) -> serve"
    PARTS=${PARTS:-4} PARTS_PER_CALL=${PARTS_PER_CALL:-2} REUSE=${REUSE:-1} PARITY_S=${PARITY_S:-520} \
        python3 -m lab.gpu.gpu_realsize --out "$OUT" --preset "${PRESET:-kl-48b-8l}"
    ;;
types)
    step "cuda fast-path checks + weights.* (k3-syn-25), gpu tests of the Triton norm / router"
    timeout "${PARITY_S:-150}" python3 -m k3verify parity --device cuda --preset k3-syn-25 --only 'kernel.norm.*' \
        --only 'kernel.router.*' --only kernel.attn.sdpa_vs_torch --only 'weights.*' \
        --report-dir "$OUT/parity-types" 2>&1 | quiet | tail -12
    timeout "${PYTEST_S:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kernels_norm.py \
        tests/kernels/test_kernels_router.py 2>&1 | tail -3
    step "bench --checkpoint (kl-tiny cache dir): resolved through k3verify/target.py"
    ckpt=$(python3 -c "from k3verify.target import resolve_target; print(resolve_target('kl-tiny').checkpoint_dir)")
    timeout "${BENCH_S:-240}" python3 -m k3verify bench --checkpoint "$ckpt" --prefill 64 --batch 1,4 \
        --new-tokens 8 --prompt-len 16 --json "$OUT/bench-ckpt.json" 2>"$OUT/bench-ckpt.log" >/dev/null
    echo "bench --checkpoint exit $?"
    python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = []
report = out / "parity-types" / "report.json"
for r in json.loads(report.read_text())["results"] if report.is_file() else []:
    rows.append({"what": r["id"], "status": r["status"], "control": (r.get("control") or {}).get("status", "-")})
bench = out / "bench-ckpt.json"
if bench.is_file():
    data = json.loads(bench.read_text())
    rows.append({"what": f"bench --checkpoint ({data['preset']})", "status": "speeds" if data["speeds_reported"]
                 else "no speeds", "control": "-", "notes": data["notes"]})
else:
    rows.append({"what": "bench --checkpoint", "status": "no JSON (see bench-ckpt.log)", "control": "-"})
(out / "types.json").write_text(json.dumps(rows, indent=1))
for r in rows:
    print(f"{r['what']:40} {r['status']:14} control {r['control']}")
    for n in r.get("notes", []):
        print(f"    note: {n}")
PY
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
invariance)
    # Is a seeded request's text batch-invariant on CUDA? k3-tiny, a prompt alone vs packed with 1, 3 or 7
    # others, eager and CUDA-graph decode (graph buckets pad the batch), fp32 and bf16; a table + $OUT/invariance.json
    step "batch invariance on cuda (k3-tiny, --trials ${TRIALS:-3} --steps ${STEPS:-8})"
    timeout "${INVARIANCE_S:-240}" python3 tools/batch_invariance.py --device cuda --trials "${TRIALS:-3}" \
        --steps "${STEPS:-8}" --json "$OUT/invariance.json" 2>&1 | quiet | tail -16
    ;;
round)
    # Batch invariance and the served engine on hardware (~5 min cold): seeded batch invariance, then the served engine's CUDA checks;
    # each step logs under $OUT as it runs, so a call cut short still brings back what finished. `spec` and
    # `mxfp4` follow as calls of their own. 2026-12-01, one cold call with everything at tight budgets: the
    # invariance and engine steps left no output at 45 s each (cold Triton compiles on k3-tiny, by the timing),
    # and the spec bench ran out of SPEC_S=120 inside the transformers+fla gold/baseline.
    TRIALS=${TRIALS:-2} STEPS=${STEPS:-6} INVARIANCE_S=${INVARIANCE_S:-150} bash "$0" invariance \
        >"$OUT/round-invariance.log" 2>&1
    step "served engine on cuda: serving.engine.* + serving.graph.* (k3-tiny)"
    timeout "${ENGINE_S:-240}" python3 -m k3verify parity --device cuda --preset k3-tiny --only 'serving.engine.*' \
        --only 'serving.graph.*' --report-dir "$OUT/parity-engine" >"$OUT/round-engine.log" 2>&1
    echo "engine checks exit $?" >>"$OUT/round-engine.log"
    # the decode launch makes no synchronising call (torch's sync debug mode raises on any)
    timeout "${PYTEST_S:-90}" python3 -m pytest -q -rA --tb=short -m gpu -p no:cacheprovider \
        tests/serving/test_step_loop.py >"$OUT/round-nosync.log" 2>&1
    for part in invariance engine nosync; do step "$part"; quiet <"$OUT/round-$part.log" | tail -25; done
    ;;
*)
    echo "usage: bash lab/gpu/gpu_session.sh parity|noise|bench|bench-k3|prefill|moe|tail|engine|spec-round|served-profile|sdpa|gemm|score-tune|mutate-cuda|mutate-moe|mxfp4|spec|realsize|endpoint|plan|invariance|round|types" >&2
    exit 2
    ;;
esac
for next in ${THEN:-}; do  # more cases in the same call, in order (THEN=spec, THEN="bench mutate-moe", ...)
    THEN= bash "$0" "$next"
done
step "done"
