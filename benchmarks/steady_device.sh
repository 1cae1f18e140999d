#!/usr/bin/env bash
# Issue 7's steady gap on the lent GPU, after MLX's CUDA build is staged:
#   source .device/part-b/activate.sh && bash benchmarks/steady_device.sh
# 1. benchmarks/steady_gap.py (mx.addmm and tma_st 192x192x64/8/8): wall, submit and the GPU's
#    own span of steady rounds (global-timer stamps), MLX's CUDA graphs on then off; torch's
#    wall and event times in the same processes.
# 2. qkv sweeps of tma_st with graphs on, off, on, off (gemm_wg3_device.sh sweeps; SWEEP_TREES
#    as there, e.g. "new old" against .old/main/src).
# SM clock, power and throttle reasons are sampled every 100 ms throughout (clocks.csv).
set -u
OUT="${OUT:-/tmp/steady}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx}"
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 100 > "$OUT/clocks.csv" 2>&1 &
smi=$!
for g in ${GAP_GRAPHS:-1 0}; do
  echo "== steady_gap, MLX_USE_CUDA_GRAPHS=$g"
  MLX_USE_CUDA_GRAPHS=$g timeout "${GAP_S:-150}" python3 benchmarks/steady_gap.py \
    ${GAP_CONFIGS:-addmm tma_st:192x192x64/8/8} ${GAP_ARGS:---per-round 1,20,60 --rounds 7} \
    2>&1 | tee "$OUT/gap_graphs$g.log"
done
i=0
for g in ${SWEEP_GRAPH_ORDER:-1 0 1 0}; do
  i=$((i + 1))
  OUT="$OUT/s$i" SWEEP_GRAPHS=$g SWEEP_FAMILIES=tma_st SWEEP_TILES=192x192x64/8 WALKS=8 \
    SWEEP_ARGS="${SWEEP_ARGS:---paired 300}" SWEEP_TAIL=12 bash benchmarks/gemm_wg3_device.sh sweeps
done
kill "$smi"
# The device returns at most 8 files a call: TAR=1 packs this call's directory into one.
if [ -n "${TAR:-}" ]; then
  tar -C "$(dirname "$OUT")" -cJf "$OUT.tar.xz" "$(basename "$OUT")" && rm -rf "$OUT"
fi
