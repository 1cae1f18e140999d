# Sourced by the GEMM device scripts: ncu_times TREE LABEL CONFIGS... runs
# benchmarks/gemm_profile.py (5 calls per configuration after a warm-up) from source tree TREE
# under Nsight Compute with the clocks left alone and MLX's CUDA graphs off (the cluster
# families need that), writes $OUT/ncu_LABEL.csv and prints each kernel's mean time and SM clock
# over the 5 calls (the warm-up call left out).
ncu_times() {  # tree label configs...
  local tree="$1" label="$2"
  shift 2
  PYTHONPATH="$tree${BASE_PATH:+:$BASE_PATH}" MLX_USE_CUDA_GRAPHS=0 timeout 200 ncu \
    --clock-control none --csv -k "regex:gemm|nvjet|qsa" \
    --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__cycles_elapsed.max \
    python3 benchmarks/gemm_profile.py --calls 5 "$@" > "$OUT/ncu_$label.csv" 2> "$OUT/ncu_$label.err"
  echo "-- ncu $label: $*"
  python3 benchmarks/ncu_summary.py "$OUT/ncu_$label.csv" "$#" --skip 1
}
