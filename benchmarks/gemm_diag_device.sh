#!/usr/bin/env bash
# The cluster GEMM families against cuBLASLt and tma_st, MLX's CUDA graphs off (the cluster
# families need them off), on the lent GPU after MLX's CUDA build is staged:
#   source .device/part-b/activate.sh && bash benchmarks/gemm_diag_device.sh [full]
# Runs the cluster tests, kernel times (ncu, 5 calls each), and steady qkv sweeps of tma_st,
# tma_mc_st and tma_mc; `full` first records Nsight Compute's full set of one call each
# (full.ncu-rep and its details page).
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MLX_USE_CUDA_GRAPHS=0
OUT="${OUT:-/tmp/gemm-diag}"
mkdir -p "$OUT/diag"
if [ "${1:-}" = full ]; then
  timeout 240 ncu --clock-control none --set full -k "regex:gemm|nvjet" -o "$OUT/diag/full" \
    python3 benchmarks/gemm_profile.py --calls 1 addmm tma_st:192x192x64/8/4 \
    tma_mc_st:192x192x64/8/8 tma_mc:192x192x64/8/8 > "$OUT/diag/ncu_full.log" 2>&1
  ncu -i "$OUT/diag/full.ncu-rep" --page details > "$OUT/diag/details.txt" 2>&1
  grep -E "^  [a-z_]|Duration|SM Frequency|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Issue Slots Busy|Warp Cycles Per Issued" \
    "$OUT/diag/details.txt" | cut -c1-150
fi
timeout 240 python3 -m pytest -o addopts= -q -rs -p no:cacheprovider tests/test_gemm_cuda.py \
  -k "cluster or tma_mc" 2>&1 | tail -4
NCU_CONFIGS="${NCU_CONFIGS:-addmm tma_st:192x192x64/8/4 tma_mc_st:192x192x64/8/8 tma_mc_st:192x192x64/8/4 tma_mc:192x192x64/8/8 tma_mc_st:128x256x64/8/8}" \
  OUT="$OUT/gemm" bash benchmarks/gemm_st_device.sh ncu
for fam in tma_st tma_mc_st tma_mc; do
  echo "-- steady sweep, graphs off, family $fam"
  timeout 150 python3 -m mlx_qsa sweep --op attn.qkv_proj --tokens 4181 --warmup 2 --repeats 5 \
    --steady 20x7 --family "$fam" --tiles 192x192x64/8,128x256x64/8 --walk-m 4,8 \
    --out "$OUT/diag/qkv_${fam}_nographs.json" 2>&1 | tail -7
done
