#!/usr/bin/env bash
# The TMA-store epilogue (family tma_st) against the TMA kernel that stores from registers
# (family tma), on the lent GPU after MLX's CUDA build is staged:
#   source .device/part-b/activate.sh && bash benchmarks/gemm_st_device.sh tests ncu sweeps ops
# tests:  the tma_st configurations of tests/test_gemm_cuda.py and the bit-equality test
#         (TESTS_K overrides the -k expression)
# ncu:    kernel times (Nsight Compute, clocks not locked) of mx.addmm and both families at the
#         two best tiles, 5 calls each after a warm-up call (NCU_CONFIGS overrides the list)
# sweeps: attn.qkv_proj sweeps of both families, interleaved twice (tma, tma_st, tma, tma_st),
#         with --steady 20x7 (each sweep measures its own mx.addmm baseline)
# ops:    attn.o_proj and indexer.qk_proj, both families once
# alltests: tests/test_gemm_cuda.py and tests/test_sweep.py, every family
# launch: Nsight Compute's LaunchStats and Occupancy sections of a tma_mc_st and a tma_st kernel
# order:  benchmarks/gemm_st_order.py with the cluster guard lifted, graphs on, then off
# (the ncu step's NCU_CONFIGS may name tma_mc*: run it with MLX_USE_CUDA_GRAPHS=0)
set -uo pipefail
OUT="${OUT:-/tmp/gemm-st}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx}"
mkdir -p "$MLX_PTX_CACHE_DIR"
TILES="192x192x64/8,128x256x64/8"
# gemm_profile.py configurations timed by the ncu step
NCU_CONFIGS="${NCU_CONFIGS:-addmm tma:192x192x64/8/16 tma_st:192x192x64/8/16 tma:128x256x64/8/8 tma_st:128x256x64/8/8}"
sweep() {  # op family tiles walks out
  timeout 120 python3 -m mlx_qsa sweep --op "$1" --tokens 4181 --warmup 2 --repeats 5 \
    --steady 20x7 --family "$2" --tiles "$3" --walk-m "$4" --out "$OUT/$5" 2>&1 | tail -12
}
rc=0
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  for what in "$@"; do
    echo "== $what"
    case "$what" in
      tests)
        timeout 240 python3 -m pytest -o addopts= -q -rs -p no:cacheprovider \
          tests/test_gemm_cuda.py -k "${TESTS_K:-tma_st or tma_gemm_is_deterministic}" 2>&1 \
          | tail -8 ;;
      ncu)
        timeout 200 ncu --clock-control none --csv -k "regex:gemm|nvjet|qsa" \
          --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__cycles_elapsed.max \
          python3 benchmarks/gemm_profile.py --calls 5 $NCU_CONFIGS \
          > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
        python3 benchmarks/ncu_summary.py "$OUT/ncu.csv" "$(echo $NCU_CONFIGS | wc -w)" ;;
      sweeps)
        for round in 1 2; do
          for fam in tma tma_st; do
            echo "-- round $round family $fam"
            sweep attn.qkv_proj "$fam" "$TILES" 8,16 "qkv_${fam}_$round.json"
          done
        done ;;
      ops)
        for op in attn.o_proj indexer.qk_proj; do
          for fam in tma tma_st; do
            echo "-- $op family $fam"
            sweep "$op" "$fam" "$TILES,128x128x64/4" 8 "${op}_${fam}.json"
          done
        done ;;
      alltests)  # every GEMM test on the GPU (all families)
        timeout 400 python3 -m pytest -o addopts= -q -rs -p no:cacheprovider \
          tests/test_gemm_cuda.py tests/test_sweep.py 2>&1 | tail -8 ;;
      launch)  # Nsight Compute's launch and occupancy sections of one cluster and one plain kernel
        MLX_USE_CUDA_GRAPHS=0 timeout 150 ncu --clock-control none -k "regex:qsa_gemm" -c 2 --section LaunchStats \
          --section Occupancy python3 benchmarks/gemm_profile.py tma_mc_st:192x192x64/8/8 \
          tma_st:192x192x64/8/8 > "$OUT/ncu_launch.txt" 2>&1
        grep -v "^==PROF==" "$OUT/ncu_launch.txt" | grep -i "cluster\|grid\|block\|waves\|occupancy\|shared\|registers" ;;
      order)  # the cluster / tma_st order dependence, guard lifted, graphs on then off
        timeout 120 python3 benchmarks/gemm_st_order.py --unguarded 2>&1 | tail -10
        MLX_USE_CUDA_GRAPHS=0 timeout 120 python3 benchmarks/gemm_st_order.py --unguarded 2>&1 \
          | tail -10 ;;
      *) echo "unknown step $what"; rc=1 ;;
    esac
  done
} 2>&1 | tee -a "$OUT/gpu.log"
exit $rc
