#!/usr/bin/env bash
# The GEMM on the lent GPU: tests, kernel times, profiles, sweeps and host cost of this tree,
# against the tree in .old/main/src; after MLX's CUDA build is staged:
#   source .device/part-b/activate.sh && bash benchmarks/gemm_wg3_device.sh tests|ncu|sweeps ...
# tests:  tests/test_gemm_cuda.py and tests/test_sweep.py (the cluster cases in their own process
#         without CUDA graphs; TESTS_K, when set, is pytest's -k expression)
# ncu:    kernel times, 5 calls each after one warm-up, graphs off (the cluster family needs it),
#         this tree (NCU_NEW configs) then the old one (NCU_OLD; OLD= empty skips it)
# NEW and OLD (source trees) default to ./src and ./.old/main/src
# profile: Nsight Compute's full set of one call of each PROFILE configuration (this tree, graphs
#         off): details page, its summary lines, and per-instruction stall samples (sass CSV)
# sweeps: steady qkv sweeps, tma_st with graphs on (the default), tma_mc_st with graphs off;
#         SWEEP_TREES (default "new") names the trees in order, e.g. "old new old new";
#         SWEEP_ARGS: more sweep options (e.g. "--paired 200"); SWEEP_FAMILIES (default
#         "tma_st tma_mc_st"); SWEEP_GRAPHS=0 runs the non-cluster families without graphs too
# host:   host cost per call: benchmarks/source_size_ab.py (this tree), then
#         benchmarks/gemm_host_cost.py for HOST_CONFIGS (HOST_ARGS: its options) in the old
#         tree and this one
# gap:    benchmarks/steady_gap.py (this tree): submit against wall time of steady calls
# dtests: the CUDA decode and prefill tests (this tree)
set -u
OUT="${OUT:-/tmp/gemm-wg3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx}"
BASE_PATH="${PYTHONPATH:-}"
NEW="${NEW:-$PWD/src}"
OLD="${OLD-$PWD/.old/main/src}"
date -u +%Y-%m-%dT%H:%M:%SZ
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
source "$(dirname "${BASH_SOURCE[0]}")/gemm_ncu_times.sh"
for what in "$@"; do
  case "$what" in
    tests)
      echo "== tests"
      select=()
      [ -n "${TESTS_K:-}" ] && select=(-k "$TESTS_K")
      PYTHONPATH="$NEW:$BASE_PATH" timeout 480 python3 -m pytest -o addopts= -q -rs -p no:cacheprovider \
        tests/test_gemm_cuda.py tests/test_sweep.py "${select[@]}" 2>&1 | tee "$OUT/tests.log" | tail -4 ;;
    ncu)
      echo "== ncu"
      ncu_times "$NEW" new ${NCU_NEW:-addmm tma_st:192x192x64/8/8 tma_st:192x192x64/12/8 \
        tma_st:192x192x64/12/4 tma_mc_st:192x192x64/12/8 tma:192x192x64/12/8}
      [ -n "$OLD" ] && ncu_times "$OLD" old ${NCU_OLD:-addmm tma_st:192x192x64/8/8} ;;
    profile)
      echo "== profile"
      PYTHONPATH="$NEW:$BASE_PATH" MLX_USE_CUDA_GRAPHS=0 timeout 300 ncu --clock-control none \
        --set full --import-source no -k "regex:gemm|nvjet" -o "$OUT/full" python3 \
        benchmarks/gemm_profile.py --calls 1 ${PROFILE:-addmm tma_st:192x192x64/8/8} \
        > "$OUT/full.log" 2>&1
      ncu -i "$OUT/full.ncu-rep" --page details > "$OUT/details.txt" 2>&1
      ncu -i "$OUT/full.ncu-rep" --page source --print-source sass --csv > "$OUT/sass.csv" 2>&1
      xz -f "$OUT/sass.csv" "$OUT/details.txt"
      rm -f "$OUT/full.ncu-rep"
      xz -dc "$OUT/details.txt.xz" | grep -E "^  [a-z_]|Duration|SM Frequency|Compute \(SM\) Throughput|L2 Cache Throughput|L2 Hit Rate|DRAM Throughput|Issue Slots Busy|Warp Cycles Per Issued" \
        | cut -c1-150 ;;
    host)
      echo "== host"
      PYTHONPATH="$NEW:$BASE_PATH" timeout 90 python3 benchmarks/source_size_ab.py "$OUT/source_size.json"
      for tree in ${OLD:+old} new; do
        src="$NEW"; [ "$tree" = old ] && src="$OLD"
        echo "-- $tree"
        PYTHONPATH="$src:$BASE_PATH" timeout 150 python3 benchmarks/gemm_host_cost.py \
          ${HOST_CONFIGS:-addmm tma_st:192x192x64/8/8} ${HOST_ARGS:-}
      done 2>&1 | tee "$OUT/host_cost.log" ;;
    gap)
      echo "== gap"
      PYTHONPATH="$NEW:$BASE_PATH" timeout 150 python3 benchmarks/steady_gap.py \
        ${GAP_CONFIGS:-addmm tma_st:192x192x64/8/8} 2>&1 | tee "$OUT/steady_gap.log" ;;
    dtests)
      echo "== dtests"
      PYTHONPATH="$NEW:$BASE_PATH" timeout 240 python3 -m pytest -o addopts= -q -x -rs \
        -p no:cacheprovider tests/test_cuda_decode.py tests/test_cuda_prefill.py 2>&1 \
        | tee "$OUT/dtests.log" | tail -4 ;;
    sweeps)
      echo "== sweeps"
      k=0
      for tree in ${SWEEP_TREES:-new}; do
      k=$((k + 1))
      src="$NEW"; [ "$tree" = old ] && src="$OLD"
      for fam in ${SWEEP_FAMILIES:-tma_st tma_mc_st}; do
        graphs=${SWEEP_GRAPHS:-1}
        tiles=192x192x64/8,192x192x64/12
        if [ "$fam" = tma_mc_st ]; then
          [ -n "${SWEEP_ST_ONLY:-}" ] && continue
          graphs=0
          tiles=192x192x64/12
        fi
        echo "-- $tree tree, family $fam, MLX_USE_CUDA_GRAPHS=$graphs"
        PYTHONPATH="$src:$BASE_PATH" MLX_USE_CUDA_GRAPHS=$graphs timeout 200 python3 -m mlx_qsa sweep \
          --op attn.qkv_proj --tokens 4181 --warmup 2 --repeats 5 --steady 20x7 --family "$fam" \
          --tiles "${SWEEP_TILES:-$tiles}" --walk-m "${WALKS:-4,8}" --out "$OUT/qkv_${fam}_$tree$k.json" \
          ${SWEEP_ARGS:-} 2>&1 | tail -"${SWEEP_TAIL:-7}"
      done
      done ;;
    *) echo "unknown step $what" ;;
  esac
done
