#!/usr/bin/env bash
# 192x192 tiles as three 64x192 consumer warpgroups (12 warps, one m64n192 wgmma per k-step)
# against two 192x96 ones (8 warps, three m64n96), and the bias pairs loaded before the k-loop,
# against the tree in .old/main/src; on the lent GPU after MLX's CUDA build is staged:
#   source .device/part-b/activate.sh && bash benchmarks/gemm_wg3_device.sh tests|ncu|sweeps ...
# tests:  tests/test_gemm_cuda.py and tests/test_sweep.py (the cluster cases in their own process
#         without CUDA graphs; TESTS_K, when set, is pytest's -k expression)
# ncu:    kernel times, 5 calls each after one warm-up, graphs off (the cluster family needs it),
#         this tree (NCU_NEW configs) then the old one (NCU_OLD; OLD= empty skips it)
# NEW and OLD (source trees) default to ./src and ./.old/main/src
# profile: Nsight Compute's full set of one call of each PROFILE configuration (this tree, graphs
#         off): details page, its summary lines, and per-instruction stall samples (sass CSV)
# sweeps: steady qkv sweeps, tma_st with graphs on (the default), tma_mc_st with graphs off
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
    sweeps)
      echo "== sweeps"
      for fam in tma_st tma_mc_st; do
        graphs=1
        tiles=192x192x64/8,192x192x64/12
        if [ "$fam" = tma_mc_st ]; then
          [ -n "${SWEEP_ST_ONLY:-}" ] && continue
          graphs=0
          tiles=192x192x64/12
        fi
        echo "-- family $fam, MLX_USE_CUDA_GRAPHS=$graphs"
        PYTHONPATH="$NEW:$BASE_PATH" MLX_USE_CUDA_GRAPHS=$graphs timeout 200 python3 -m mlx_qsa sweep \
          --op attn.qkv_proj --tokens 4181 --warmup 2 --repeats 5 --steady 20x7 --family "$fam" \
          --tiles "$tiles" --walk-m "${WALKS:-4,8}" --out "$OUT/qkv_$fam.json" 2>&1 | tail -"${SWEEP_TAIL:-7}"
      done ;;
    *) echo "unknown step $what" ;;
  esac
done
