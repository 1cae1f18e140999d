#!/usr/bin/env bash
# The TMA store staged in the ring's last stages (4 stages at 192x192x64) against the tree in
# .old/main/src (a separate staging tile, 3 stages), on the lent GPU after MLX's CUDA build is
# staged:  source .device/part-b/activate.sh && bash benchmarks/gemm_ring_device.sh
# tests: the tma_st / cluster cases of tests/test_gemm_cuda.py (the cluster ones in their own
# process without CUDA graphs); ncu: kernel times, 5 calls each, graphs off (cluster families
# need it), the new tree then the old; sweeps: steady qkv sweeps, tma_st with graphs on (the
# default), tma_mc_st with graphs off.
set -u
OUT="${OUT:-/tmp/gemm-ring}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx}"
BASE_PATH="${PYTHONPATH:-}"
NEW="$PWD/src"
OLD="$PWD/.old/main/src"
date -u +%Y-%m-%dT%H:%M:%SZ
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
echo "== tests"
PYTHONPATH="$NEW:$BASE_PATH" timeout 200 python3 -m pytest -o addopts= -q -rs -p no:cacheprovider \
  tests/test_gemm_cuda.py -k "tma_st or tma_mc or cluster or deterministic" 2>&1 | tail -4
source "$(dirname "${BASH_SOURCE[0]}")/gemm_ncu_times.sh"
echo "== ncu"
ncu_times "$NEW" new addmm tma_st:192x192x64/8/4 tma_st:192x192x64/8/8 tma_mc_st:192x192x64/8/4 tma_mc_st:192x192x64/8/8
ncu_times "$OLD" old addmm tma_st:192x192x64/8/4 tma_st:192x192x64/8/8
echo "== sweeps"
for fam in tma_st tma_mc_st; do
  graphs=1
  [ "$fam" = tma_mc_st ] && graphs=0
  echo "-- family $fam, MLX_USE_CUDA_GRAPHS=$graphs"
  PYTHONPATH="$NEW:$BASE_PATH" MLX_USE_CUDA_GRAPHS=$graphs timeout 150 python3 -m mlx_qsa sweep \
    --op attn.qkv_proj --tokens 4181 --warmup 2 --repeats 5 --steady 20x7 --family "$fam" \
    --tiles 192x192x64/8,128x256x64/8 --walk-m 4,8 --out "$OUT/qkv_$fam.json" 2>&1 | tail -7
done
