#!/usr/bin/env bash
# GEMM tile sweep on the lent GPU, in one device call (after MLX's CUDA build is staged):
#   source .device/part-b/activate.sh && bash benchmarks/sweep_device.sh
# Runs the CUDA GEMM tests, then the sweeps, and writes everything under $OUT (or
# /tmp/sweep-out): gpu.log (tests, sweep progress, comparison), the sweep JSON files and a tar of
# MLX's PTX cache (carry it as .ptxcache/ptx-cache.tar.gz to skip NVRTC compiles next time; on
# 2026-12-03 the cache directory stayed empty, so expect NVRTC compiles, about 1.5 s each).
# SWEEP_SKIP_TESTS=1 skips the tests (when they already passed on this source in an earlier call);
# SWEEP_SKIP_EXTRA=1 skips the cp.async larger-tile sweep of attn.qkv_proj;
# SWEEP_SKIP_GRID=1 skips the default-grid sweep (the cp.async families on the fixture's grid).
# SWEEP_STEADY (default 20x7) is the --steady argument of the larger-tile sweeps: per-call
# throughput of back-to-back calls beside the schema's one-call samples.
set -uo pipefail
OUT="${OUT:-/tmp/sweep-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx}"
mkdir -p "$MLX_PTX_CACHE_DIR"
if [ -f .ptxcache/ptx-cache.tar.gz ]; then tar -C "$MLX_PTX_CACHE_DIR" -xzf .ptxcache/ptx-cache.tar.gz; fi
LOG="$OUT/gpu.log"
FIXTURE=tests/data/qkv_tile_sweep_m5pro.json
EXTRA_TILES="128x256x64/8,256x128x64/8,128x128x64/8,128x256x128/8,128x128x64/4,64x256x64/4"
TMA_TILES="192x192x64/8,128x192x64/8,64x192x64/4"  # warpgroup N extents 96 and 192: TMA only
STEADY="${SWEEP_STEADY:-20x7}"
py() { python3 "$@"; }

{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit \
    --format=csv 2>&1
  py -c "import mlx.core as mx; print('mlx', mx.__version__, mx.device_info(mx.gpu))"

  if [ -z "${SWEEP_SKIP_TESTS:-}" ]; then
    echo "== tests"
    timeout 300 python3 -m pytest -o addopts= -q -rs tests/test_gemm_cuda.py tests/test_sweep.py 2>&1 | tail -60
    echo "tests rc=${PIPESTATUS[0]}"
  fi

  if [ -z "${SWEEP_SKIP_GRID:-}" ]; then
  echo "== sweep attn.qkv_proj, default grid"
  timeout 150 python3 -m mlx_qsa sweep --op attn.qkv_proj --tokens 4181 --warmup 2 --repeats 5 \
    --out "$OUT/qkv_tile_sweep_h200.json"
  echo "sweep rc=$?"
  fi

  if [ -z "${SWEEP_SKIP_EXTRA:-}" ]; then
  echo "== sweep attn.qkv_proj, extra tiles"
  timeout 80 python3 -m mlx_qsa sweep --op attn.qkv_proj --tokens 4181 --warmup 2 --repeats 5 \
    --tiles "$EXTRA_TILES" --walk-m 8,16 --steady "$STEADY" --out "$OUT/qkv_tile_sweep_h200_extra.json"
  echo "sweep rc=$?"
  fi

  echo "== sweep attn.qkv_proj, family tma (TMA producer warp, persistent grid)"
  timeout 80 python3 -m mlx_qsa sweep --op attn.qkv_proj --tokens 4181 --warmup 2 --repeats 5 \
    --tiles "$EXTRA_TILES,$TMA_TILES" --walk-m 0,8,16 --family tma --steady "$STEADY" --out "$OUT/qkv_tile_sweep_h200_tma.json"
  echo "sweep rc=$?"

  echo "== sweep attn.qkv_proj, family tma_mc (clusters of two, W multicast)"
  # cluster kernels run only without MLX's CUDA graphs (kernels/gemm.py, cluster_launch_unsupported)
  MLX_USE_CUDA_GRAPHS=0 timeout 80 python3 -m mlx_qsa sweep --op attn.qkv_proj --tokens 4181 --warmup 2 --repeats 5 \
    --tiles "128x256x64/8,256x128x64/8,192x192x64/8,128x128x64/4" --walk-m 8,16 --family tma_mc \
    --steady "$STEADY" --out "$OUT/qkv_tile_sweep_h200_tma_mc.json"
  echo "sweep rc=$?"

  for op in attn.o_proj indexer.qk_proj; do
    echo "== sweep $op"
    timeout 45 python3 -m mlx_qsa sweep --op "$op" --tokens 4181 --warmup 2 --repeats 5 \
      --tiles "$EXTRA_TILES,128x128x128/8,64x128x256/4,128x64x256/4" --walk-m 8 --steady "$STEADY" \
      --out "$OUT/${op//./_}_tile_sweep_h200.json"
    echo "sweep rc=$?"
    echo "== sweep $op, family tma"
    timeout 45 python3 -m mlx_qsa sweep --op "$op" --tokens 4181 --warmup 2 --repeats 5 \
      --tiles "$EXTRA_TILES,$TMA_TILES" --walk-m 8 --family tma --steady "$STEADY" --out "$OUT/${op//./_}_tile_sweep_h200_tma.json"
    echo "sweep rc=$?"
  done

  tar -C "$MLX_PTX_CACHE_DIR" -czf "$OUT/ptx-cache.tar.gz" . 2>/dev/null

  for f in "$OUT"/qkv_tile_sweep_h200.json "$OUT"/qkv_tile_sweep_h200_extra.json \
    "$OUT"/qkv_tile_sweep_h200_tma.json "$OUT"/qkv_tile_sweep_h200_tma_mc.json; do
    [ -f "$f" ] || continue
    echo "== compare $FIXTURE $f"
    py -m mlx_qsa sweep --compare "$FIXTURE" "$f"
  done
} 2>&1 | tee "$LOG"
