#!/usr/bin/env bash
# Issue 5 on the lent GPU, after MLX's CUDA build is staged (../shared/device/README.md):
#   source .device/part-b/activate.sh && bash benchmarks/decode_device.sh tests|trace|bench|prefill
# tests:   the decode kernels' tests (test_cuda_decode.py)
# tests2:  the other CUDA tests: prefill kernels, layer, RoPE, RMSNorm, bench (GPU columns), turns
#          (it overran a 600 s call after `bench`: `ptests` is its first half, tests2b the rest)
# gemmtests: the custom GEMM's tests and the sweep's (a call of their own)
# ptests:  the prefill kernel tests and the CUDA layer tests only
# ktests:  the prefill kernel tests and the CUDA layer's prefill tests
# trace:   `mlx-qsa trace` on the GPU, compared field by field with the M5 Pro fixture
# bench:   `mlx-qsa bench decode` at the issue's contexts and rows (all peers, one process;
#          BENCH_ARGS, e.g. "--contexts 128k --rows 1,4"; BENCH_TIMEOUT)
# prefill: `mlx-qsa bench prefill` (whole-layer chunks; few samples; PREFILL_ARGS, e.g.
#          "--contexts 32k,128k"; PREFILL_TIMEOUT)
# prompt:  `mlx-qsa bench prompt` (whole prompts in chunks through one layer, defaults and the
#          large-prefill lane; PROMPT_ARGS, default "--contexts 8k,32k --large-from 8192
#          --no-portable";
#          PROMPT_TIMEOUT)
# overhead: host µs per MLX primitive, CUDA graphs on and off (benchmarks/mlx_overhead.py)
# quick:   a decode subset with CUDA graphs on and off
# parts:   the prefill kernels one at a time, prefill_flash against its forms (loads alone, math
#          alone), bytes floor, selection overlap (prefill_parts.py; PARTS_PREFIXES, default
#          32k,128k)
# partsgraphs: the same with CUDA graphs on, then off (default prefix 32k)
# ncuprefill: Nsight Compute sections of the prefill kernels (NCU_PREFIXES, default 32768 131072)
# ncuproducer: the prefill score producer's per-instruction warp stalls (source page, SASS) and
#          its sections, one launch at each of NCU_PREFIXES
# tp1:     bench --tp 1 through mlx.launch --backend nccl (a group of one on this GPU)
# decodeab: the 128K decode point three times in a row (run-to-run spread), distinct files
# gate:    the fused output gate's GPU tests and the layer-step A/B (benchmarks/gate_ab.py)
# shared:  prefill_flash over shared tiles: test_cuda_prefill.py, then benchmarks/prefill_shared_ab.py
#          (per row vs shared tiles vs torch at drifting selection overlaps; SHARED_PREFIXES)
# ncushared: Nsight Compute of prefill_flash over shared tiles and per row, with stall reasons
# ncusdpa: Nsight Compute sections of the sdpa kernel at 2048 rows after NCU_SDPA_PREFIX (8192),
#          tilings NCU_SDPA_FORMS (64x2; e.g. "64x2 32x3 64x2_kv")
# sdpa:    the masked-attention kernel's tests, the CUDA layer's masked chunks, then
#          benchmarks/sdpa_ab.py (kernel vs MLX's SDPA vs torch; sdpaquick: its 2048-row points)
#          and benchmarks/sdpa_layer_ab.py (the whole layer, kernel on and off); sdpatests: the
#          tests only
# selsweep: the prefill score producer's warps (and GB: SELSWEEP_ARGS="--gbs 2,8") and the
#          top-k's threads and candidate room, in turns (select_sweep.py)
# divtests: the score division against __fdiv_rn over every float32 (test_cuda_exact_div.py),
#          then the selector tests that compare scores and selections with the portable path
# seldiff: rows whose CUDA prefill selection differs from the portable one, with float64 scores
#          (benchmarks/selection_diff.py; SELDIFF_PREFIXES, default 16384; SELDIFF_SETS, default 2)
# stamptest: the GPU timer stamp (test_cuda_stamp.py) and the bench document tests
# compileab: the decode step (selection + attention) eager against mx.compile'd, in turns, with
#          its graph build alone (benchmarks/compile_ab.py; COMPILEAB_ARGS, e.g. "--points 131072x1")
# compiledecode: compileab at 128K (1, 4 rows) and 8K, then the layer step with
#          MLX_QSA_COMPILE_DECODE unset vs 0 (gate_ab.py --switch); compiletests: their GPU tests,
#          the selector's stamps build and the bench's compiled selector
# selphases: the decode selector's phases by its SM clock stamps, and its forms on the GPU clock
#          in turns (benchmarks/select_phases.py; SELPHASES_ARGS, e.g. "--points 131072x1")
# timeline: benchmarks/timeline.py (CUPTI timeline of decode and prefill steps; TIMELINE_ARGS)
# Test steps run under TEST_TIMEOUT seconds each (default 420) and append each failure's report
# to $OUT/failures.txt as it happens (QSA_FAIL_LOG, tests/conftest.py): a call stopped at its
# limit still says why a test failed.
# Everything goes under $OUT; files are named after the card (h100, h200). nvidia-smi samples
# clocks, power and throttle reasons every 200 ms into smi.csv. TAR=1 packs $OUT into one file
# (the device returns at most 8 a call).
set -uo pipefail
OUT="${OUT:-/tmp/qsa-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export QSA_FAIL_LOG="$OUT/failures.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/when.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv \
  | tee "$OUT/gpu.txt"
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
  *H200*) GPU_TAG=h200 ;;
  *H100*) GPU_TAG=h100 ;;
  *) GPU_TAG=gpu ;;
esac
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 200 > "$OUT/smi.csv" 2>/dev/null &
smi=$!
rc=0
# pytest_step NAME LIMIT LINES TESTS...: the GPU tests TESTS under LIMIT seconds, logged to
# $OUT/NAME.log, the last LINES lines shown; a failure sets rc
pytest_step() {
  local name=$1 limit=$2 lines=$3
  shift 3
  timeout "$limit" python3 -m pytest -o addopts= -q -rs -p no:cacheprovider "$@" 2>&1 \
    | tee "$OUT/$name.log" | tail -"$lines"
  rc=$((rc | PIPESTATUS[0]))
}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for what in "$@"; do
  case "$what" in
    tests)  # the decode kernels' tests; `tests2` has the rest
      pytest_step tests "${TEST_TIMEOUT:-420}" 20 tests/test_cuda_decode.py ;;
    tests2)  # prefill kernels, the CUDA layer, RoPE, RMSNorm, bench, turns:
             # `tests` and these overran one 420 s step together (2026-12-07)
      pytest_step tests2 "${TEST_TIMEOUT:-420}" 20 \
        tests/test_cuda_prefill.py tests/test_cuda_layer.py tests/test_cuda_rope.py \
        tests/test_cuda_rms_norm.py tests/test_bench.py tests/test_turns.py ;;
    tests2b)  # the second half of tests2
      pytest_step tests2b "${TEST_TIMEOUT:-420}" 20 \
        tests/test_cuda_rope.py tests/test_cuda_rms_norm.py tests/test_bench.py \
        tests/test_turns.py ;;
    gemmtests)  # the GEMM families' tests (~170 s on an H200): `tests` and these do not fit
                # one 600 s call together
      pytest_step gemmtests "${TEST_TIMEOUT:-420}" 20 \
        tests/test_gemm_cuda.py tests/test_sweep.py ;;
    ptests)
      pytest_step ptests "${TEST_TIMEOUT:-420}" 40 \
        tests/test_cuda_prefill.py tests/test_cuda_layer.py ;;
    sdpa|sdpaquick|sdpatests)
      pytest_step sdpa_tests 300 20 \
        tests/test_cuda_sdpa.py "tests/test_cuda_layer.py::test_masked_chunks_run_the_sdpa_kernel"
      [ "$what" = sdpatests ] && continue
      quick=""; [ "$what" = sdpaquick ] && quick="--quick"
      timeout 300 python3 benchmarks/sdpa_ab.py "$OUT/sdpa_ab_$GPU_TAG.json" $quick \
        ${SDPA_AB_ARGS:-} 2>&1 \
        | tee "$OUT/sdpa_ab.log" | tail -20
      rc=$((rc | PIPESTATUS[0]))
      timeout 200 python3 benchmarks/sdpa_layer_ab.py "$OUT/sdpa_layer_ab_$GPU_TAG.json" 2>&1 \
        | tee "$OUT/sdpa_layer_ab.log" | tail -5
      rc=$((rc | PIPESTATUS[0])) ;;
    shared)  # prefill_flash over shared tiles: the prefill kernels' tests, then the A/B
      pytest_step shared_tests 300 20 tests/test_cuda_prefill.py
      timeout 280 python3 benchmarks/prefill_shared_ab.py "$OUT/prefill_shared_ab_$GPU_TAG.json" \
        --prefixes "${SHARED_PREFIXES:-32768,131072}" ${SHARED_AB_ARGS:-} 2>&1 | tee "$OUT/prefill_shared_ab.log" | tail -20
      rc=$((rc | PIPESTATUS[0])) ;;
    ncushared)  # Nsight Compute of prefill_flash: every tile shared, then per row (32K, overlap 0.97)
      st=smsp__average_warps_issue_stalled
      stalls=$st"_long_scoreboard_per_issue_active.ratio,"$st"_short_scoreboard_per_issue_active.ratio,"
      stalls+=$st"_barrier_per_issue_active.ratio,"$st"_mio_throttle_per_issue_active.ratio,"
      stalls+=$st"_math_pipe_throttle_per_issue_active.ratio,"$st"_wait_per_issue_active.ratio,"
      stalls+=$st"_lg_throttle_per_issue_active.ratio,"$st"_not_selected_per_issue_active.ratio"
      (cd benchmarks && MLX_USE_CUDA_GRAPHS=0 timeout 240 "$NCU" --clock-control none \
        -k regex:qsa_ --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section WarpStateStats --metrics "$stalls" \
        python3 ncu_shared.py "${NCU_SHARED_PREFIX:-32768}" "${NCU_SHARED_OVERLAP:-0.97}") \
        > "$OUT/ncu_shared.txt" 2>&1
      echo "ncu shared rc $?"; grep -E "qsa_|Duration|L2 Hit|Memory Through|Achieved Occ|stalled|Warp Cycles Per Issued" \
        "$OUT/ncu_shared.txt" | head -80 ;;
    ncusdpa)  # Nsight Compute sections of the sdpa kernel (NCU_SDPA_FORMS tilings, default 64x2)
      (cd benchmarks && MLX_USE_CUDA_GRAPHS=0 timeout 240 "$NCU" --clock-control none \
        -k regex:qsa_attend --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section LaunchStats --section InstructionStats \
        python3 ncu_sdpa.py "${NCU_SDPA_PREFIX:-8192}" ${NCU_SDPA_FORMS:-64x2}) \
        > "$OUT/ncu_sdpa.txt" 2>&1
      echo "ncu sdpa rc $?"; grep -E "qsa_attend|Duration|Compute \(SM\) Th|Memory Through|L2 Hit|Achieved Occ|Registers Per|Issue Slots Busy|No Eligible|One or More" \
        "$OUT/ncu_sdpa.txt" | head -80 ;;
    trace)
      start=$(date +%s)
      timeout 400 python3 -m mlx_qsa trace --out "$OUT/trace_gpu.jsonl" 2>&1 | tail -5
      echo "trace wall $(( $(date +%s) - start )) s"
      python3 - "$OUT/trace_gpu.jsonl" <<'PY' 2>&1 | tee "$OUT/trace_compare.txt"
import json, sys
from mlx_qsa import trace
from mlx_qsa.profiles import NON_HASH_KEYS
ours = [json.loads(l) for l in open(sys.argv[1]).read().split("\n")]
ref = [json.loads(l) for l in open("tests/data/qsa_trace_m5pro.jsonl").read().split("\n")]
bad = [f"{o['kernel']}.{k}" for o, r in zip(ours, ref) for k in NON_HASH_KEYS + ("frequencies",)
       if json.dumps(o[k]) != json.dumps(r[k])]
print(f"records {len(ours)} (fixture {len(ref)}); non-hash mismatches: {len(bad)}")
for b in bad[:40]:
    print("  ", b)
print("hash-group failures:", trace.check_hash_groups(ours) or "none")
PY
      ;;
    bench)
      timeout "${BENCH_TIMEOUT:-560}" python3 -m mlx_qsa bench decode --sets 8 --repeats 5 ${BENCH_ARGS:-} \
        --out "$OUT/decode_$GPU_TAG.json" --png "$OUT/decode_$GPU_TAG.png" 2>&1 \
        | tee "$OUT/decode_run.log"
      rc=$((rc | PIPESTATUS[0])) ;;
    overhead)
      for g in 1 0; do
        MLX_USE_CUDA_GRAPHS=$g python3 benchmarks/mlx_overhead.py "$OUT/mlx_overhead_graphs$g.json"
      done ;;
    quick)
      for g in 1 0; do
        MLX_USE_CUDA_GRAPHS=$g timeout 250 python3 -m mlx_qsa bench decode --contexts 8k,128k \
          --rows 1,8 --no-torch --out "$OUT/decode_quick_graphs$g.json" 2>&1 | tee -a "$OUT/quick.log"
      done ;;
    partsgraphs)
      for g in 1 0; do
        MLX_USE_CUDA_GRAPHS=$g timeout 200 python3 benchmarks/prefill_parts.py \
          "$OUT/prefill_parts_graphs$g.json" --prefixes "${PARTS_PREFIXES:-32k}" 2>&1 \
          | tee "$OUT/prefill_parts_graphs$g.log"
      done ;;
    ktests)
      pytest_step ktests "${TEST_TIMEOUT:-420}" 20 \
        tests/test_cuda_prefill.py tests/test_cuda_layer.py -k "prefill or chunk" ;;
    parts)
      timeout 400 python3 benchmarks/prefill_parts.py "$OUT/prefill_parts.json" \
        --prefixes "${PARTS_PREFIXES:-32k,128k}" 2>&1 \
        | tee "$OUT/prefill_parts.log"
      rc=$((rc | PIPESTATUS[0])) ;;
    ncuprefill)
      for pre in ${NCU_PREFIXES:-32768 131072}; do
        MLX_USE_CUDA_GRAPHS=0 timeout 200 "$NCU" --clock-control none --cache-control all \
          -k regex:qsa_ --section SpeedOfLight --section MemoryWorkloadAnalysis \
          --section Occupancy --section WarpStateStats --section LaunchStats \
          python3 benchmarks/ncu_prefill.py $pre > "$OUT/ncu_prefill_$pre.txt" 2>&1
        echo "ncu prefill $pre rc $?"; grep -E "qsa_|Duration|DRAM Through|L2 Hit|Memory Through|Achieved Occ" \
          "$OUT/ncu_prefill_$pre.txt" | head -60
      done ;;
    ncuproducer)
      for pre in ${NCU_PREFIXES:-32768 131072}; do
        MLX_USE_CUDA_GRAPHS=0 timeout 150 "$NCU" --clock-control none --cache-control all \
          -k regex:qsa_score -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
          --section Occupancy --section WarpStateStats --section InstructionStats \
          python3 benchmarks/ncu_prefill.py $pre > "$OUT/ncu_producer_$pre.txt" 2>&1
        MLX_USE_CUDA_GRAPHS=0 timeout 150 "$NCU" --clock-control none --cache-control all \
          -k regex:qsa_score -c 1 --warp-sampling-interval 0 --section WarpStateStats \
          --section SourceCounters --page source --print-source sass --csv \
          python3 benchmarks/ncu_prefill.py $pre > "$OUT/ncu_producer_sass_$pre.csv" 2> "$OUT/ncu_producer_sass_$pre.err"
        python3 benchmarks/ncu_sass_summary.py "$OUT/ncu_producer_sass_$pre.csv" 40 2>&1 \
          | tee "$OUT/producer_sass_summary_$pre.txt" | head -50
        xz -f "$OUT/ncu_producer_sass_$pre.csv"
      done ;;
    tp1)
      timeout 300 python3 -c 'import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = "mlx.launch"; main()' \
        --backend nccl -n 1 --env NCCL_NVLS_ENABLE=0 --env "PYTHONPATH=$PYTHONPATH" -- \
        python3 -c 'import mlx.core as mx; g = mx.distributed.init(strict=True, backend="nccl"); x = mx.distributed.all_sum(mx.ones(4), group=g); mx.eval(x); print("nccl group size", g.size(), "rank", g.rank(), "all_sum", x.tolist())' \
        2>&1 | tee "$OUT/tp1_nccl_probe.log"
      timeout 400 python3 -c 'import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = "mlx.launch"; main()' \
        --backend nccl -n 1 --env NCCL_NVLS_ENABLE=0 --env "PYTHONPATH=$PYTHONPATH" -- \
        python3 -m mlx_qsa bench decode --tp 1 --contexts 32k,128k --rows 1 --out "$OUT/tp1_nccl_decode.json" \
        2>&1 | tee "$OUT/tp1_nccl.log"
      rc=$((rc | PIPESTATUS[0])) ;;
    gate)  # the fused output gate: its kernel and layer tests, then the layer-step A/B
      pytest_step gate_tests 300 8 \
        tests/test_cuda_decode.py tests/test_cuda_layer.py -k "gate"
      timeout 240 python3 benchmarks/gate_ab.py "$OUT/gate_ab_$GPU_TAG.json" 2>&1 | tee "$OUT/gate_ab.log"
      rc=$((rc | PIPESTATUS[0])) ;;
    decodeab)
      for i in 1 2 3; do
        timeout 200 python3 -m mlx_qsa bench decode --contexts 128k --rows 1 --no-torch --repeats 15 \
          --out "$OUT/decode_128k_rep$i.json" 2>&1 | tee -a "$OUT/decodeab.log" | tail -3
      done ;;
    selsweep)  # the prefill selection kernels' launch shapes (benchmarks/select_sweep.py)
      timeout "${SELSWEEP_TIMEOUT:-300}" python3 benchmarks/select_sweep.py "$OUT/select_sweep_$GPU_TAG.json" \
        ${SELSWEEP_ARGS:-} 2>&1 | tee "$OUT/select_sweep.log" | tail -8
      rc=$((rc | PIPESTATUS[0])) ;;
    divtests)  # the score division (common.cuh div_sqrt128) and the selections it scores
      pytest_step divtests "${TEST_TIMEOUT:-420}" 8 \
        tests/test_cuda_exact_div.py tests/test_cuda_decode.py tests/test_cuda_prefill.py \
        -k "exact_div or select or exact_dots or chunks or many_rows or scores_plane" ;;
    seldiff)  # why a prefill selection differs from the portable path's (float32 sum orders)
      timeout 200 python3 benchmarks/selection_diff.py --prefixes "${SELDIFF_PREFIXES:-16384}" \
        --sets "${SELDIFF_SETS:-2}" --out "$OUT/selection_diff_$GPU_TAG.json" 2>&1 \
        | tee "$OUT/selection_diff.log" | cut -c1-600 | tail -20
      rc=$((rc | PIPESTATUS[0])) ;;
    stamptest)  # the GPU timer stamp the bench's `_gpu` entries read
      pytest_step stamptest 200 5 \
        tests/test_cuda_stamp.py tests/test_bench.py ;;
    timeline)  # a CUPTI timeline (torch.profiler) of sync decode steps and a prefill chunk's parts
      timeout "${TIMELINE_TIMEOUT:-240}" python3 benchmarks/timeline.py "$OUT/timeline" ${TIMELINE_ARGS:-} \
        2>&1 | tee "$OUT/timeline.log" | tail -80
      rc=$((rc | PIPESTATUS[0])) ;;
    compileab)  # the decode step eager against mx.compile'd, in turns (benchmarks/compile_ab.py)
      timeout "${COMPILEAB_TIMEOUT:-400}" python3 benchmarks/compile_ab.py "$OUT/compile_ab_$GPU_TAG.json" \
        ${COMPILEAB_ARGS:-} 2>&1 | tee "$OUT/compile_ab.log" | tail -20
      rc=$((rc | PIPESTATUS[0])) ;;
    selphases)  # the decode selector: phase clocks and forms (benchmarks/select_phases.py)
      timeout "${SELPHASES_TIMEOUT:-300}" python3 benchmarks/select_phases.py \
        "$OUT/select_phases_$GPU_TAG.json" ${SELPHASES_ARGS:-} 2>&1 | tee "$OUT/select_phases.log" | tail -20
      rc=$((rc | PIPESTATUS[0])) ;;
    compiledecode)  # compiled decode launches: the A/B of the step forms, then the layer A/B
      timeout 200 python3 benchmarks/compile_ab.py "$OUT/compile_ab_$GPU_TAG.json" \
        --points 131072x1,131072x4,8192x1 --repeats 5 2>&1 | tee "$OUT/compile_ab.log" | tail -8
      rc=$((rc | PIPESTATUS[0]))
      timeout 150 python3 benchmarks/gate_ab.py "$OUT/compile_layer_ab_$GPU_TAG.json" \
        --switch MLX_QSA_COMPILE_DECODE 2>&1 | tee "$OUT/compile_layer_ab.log"
      rc=$((rc | PIPESTATUS[0])) ;;
    compiletests)  # their GPU tests: the CUDA layer's, the decode launch's and the fused gate's
                   # (a fresh process first compiles every kernel: 180 s was too short, r3)
      pytest_step compile_tests "${TEST_TIMEOUT:-420}" 8 \
        tests/test_cuda_layer.py tests/test_cuda_decode.py tests/test_bench.py \
        -k "layer or decode_launch or gate or stamps or qsa_step" ;;
    prompt)
      timeout "${PROMPT_TIMEOUT:-400}" python3 -m mlx_qsa bench prompt --sets 2 --repeats 3 \
        --warmup 1 ${PROMPT_ARGS:---contexts 8k,32k --large-from 8192 --no-portable} \
        --png "$OUT/prompt_$GPU_TAG.png" --out "$OUT/prompt_$GPU_TAG.json" 2>&1 \
        | tee "$OUT/prompt_run.log"
      rc=$((rc | PIPESTATUS[0])) ;;
    prefill)
      timeout "${PREFILL_TIMEOUT:-560}" python3 -m mlx_qsa bench prefill --sets 2 --repeats 3 --warmup 1 \
        ${PREFILL_ARGS:-} --png "$OUT/prefill_$GPU_TAG.png" \
        --out "$OUT/prefill_$GPU_TAG.json" 2>&1 | tee "$OUT/prefill_run.log"
      rc=$((rc | PIPESTATUS[0])) ;;
  esac
done
kill "$smi" 2>/dev/null
if [ -n "${TAR:-}" ]; then
  tar -C "$(dirname "$OUT")" -cJf "$OUT.tar.xz" "$(basename "$OUT")" && rm -rf "$OUT"
fi
exit $rc
