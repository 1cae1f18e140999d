#!/usr/bin/env bash
# Issue 5 step work on the lent GPU (after `source .device/part-b/activate.sh`):
#   bash benchmarks/step_device.sh tests|profile|ncu ...
# tests:   the CUDA decode, prefill, layer and RoPE tests
# profile: benchmarks/step_profile.py at 8K and 128K, one launch (default) and MLX_QSA_ONE_LAUNCH=0
# ncu:     the kernels of 3 steps at 128K with their SM clock and cycles (ncu --clock-control none)
# select:  one-launch against two-launch selector (MLX_QSA_SELECT_ONE_LAUNCH=1|0) at 8K-128K:
#          step_profile and the kernels' warm-cache times (ncu --cache-control none)
# ab:      step_profile of this tree against an older one in .old/src (carried), interleaved
# ab2:     the same, once each, 1 and 4 rows
# rtests:  tests/test_cuda_rope.py and tests/test_cuda_layer.py
# ntests:  the same plus tests/test_cuda_rms_norm.py where the tree has it
# bench:   mlx-qsa bench decode, the full grid, 8 sets, 5 repeats
# graphsbench: the 1-row decode grid with MLX_USE_CUDA_GRAPHS=1, 0, 1 (the setting is read
#          once per process)
# ktests:  the CUDA decode tests and the layer's concurrent-counter test only (a shorter `tests`)
# warm:    every kernel's warm-cache time at 8K and 128K, one launch each and two (ncu)
# split:   the one-launch selector scoring with one thread per indexer head against the default
#          (MLX_QSA_SELECT_SPLIT_HEADS=1|0): warm-cache kernel times and (unless SPLIT_NCU_ONLY
#          is set) step_profile at 8K-256K
# rows:    2-8 verify rows at 128K: warm-cache kernel times (ncu) and step_profile
# sass:    per-instruction (SASS) warp-stall samples of the two-launch score and top-k at 128K
# posab:   positions in MLX's small managed pool (4 bytes, as made) against a 16-byte array
#          (step_profile --pos-pad): warm-cache kernels (two launches) and steps at 8K and 128K
# kab:     warm-cache kernels (ncu) of this tree against .old/src, one and two launches, 8K and
#          128K, twice interleaved (old, new, old, new)
# managed: benchmarks/managed_read_ab.py (small operands in MLX's managed memory against device
#          memory), then its kernels under ncu
# layerab: layer_profile.py (the whole layer step) of .old/src against this tree, interleaved
# layerab8: the same at 128K in 8 rounds, summarised per round (benchmarks/ab_rounds.py)
# graphsab: step_profile with MLX's CUDA graphs on and off (MLX_USE_CUDA_GRAPHS=1|0), interleaved
# topksass: per-instruction warp-stall samples of the two-launch top-k alone at 128K, sampled
#          at the shortest interval (--warp-sampling-interval 0: 2^5 cycles) so that one ~20 us CTA
#          draws enough samples to place (the `sass` step drew 23)
# topkncu: Nsight Compute's source counters and warp states of the two-launch top-k at 128K
set -uo pipefail
OUT="${OUT:-/tmp/qsa-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/${QSA_SRC:-src}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# the trees an A/B step compares (OLD_SRC=.old/x/src picks another carried tree)
OLD="${OLD_SRC:-.old/src}"
NEW="${NEW_SRC:-src}"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/when.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
rc=0
for what in "$@"; do
  case "$what" in
    tests)
      timeout 330 python3 -m pytest -o addopts= -q -x -rs -p no:cacheprovider \
        tests/test_cuda_decode.py tests/test_cuda_prefill.py tests/test_cuda_layer.py \
        tests/test_cuda_rope.py 2>&1 | tee "$OUT/tests.log" | tail -6
      rc=$((rc | PIPESTATUS[0])) ;;
    rtests)  # the RoPE kernel's tests and the layer tests only (a shorter `tests`)
      timeout 300 python3 -m pytest -o addopts= -q -x -rs -p no:cacheprovider \
        tests/test_cuda_rope.py tests/test_cuda_layer.py 2>&1 | tee "$OUT/rtests.log" | tail -6
      rc=$((rc | PIPESTATUS[0])) ;;
    ntests)  # the norm / query-preparation / pooling kernels' tests, RoPE's and the layer's
      timeout 300 python3 -m pytest -o addopts= -q -x -rs -p no:cacheprovider \
        $(ls tests/test_cuda_rms_norm.py 2>/dev/null) tests/test_cuda_rope.py \
        tests/test_cuda_layer.py 2>&1 | tee "$OUT/ntests.log" | tail -6
      rc=$((rc | PIPESTATUS[0])) ;;
    bench)  # the full decode grid
      timeout 400 python3 -m mlx_qsa bench decode --sets 8 --repeats 5 \
        --out "$OUT/decode_h100_full.json" --png "$OUT/decode_h100_full.png" 2>&1 \
        | tee "$OUT/bench.log" | tail -20 ;;
    graphsbench)  # 1-row decode grid with MLX's CUDA graphs on, off, on (MLX_USE_CUDA_GRAPHS)
      n=0
      for g in 1 0 1; do
        n=$((n + 1))
        MLX_USE_CUDA_GRAPHS=$g timeout 150 python3 -m mlx_qsa bench decode --rows 1 --sets 8 \
          --repeats 5 --out "$OUT/decode_rows1_graphs${g}_$n.json" 2>&1 | grep '^T=' \
          | sed "s/^/graphs=$g /" | tee -a "$OUT/graphsbench.log"
      done ;;
    profile)
      for ol in 1 0; do
        MLX_QSA_ONE_LAUNCH=$ol timeout 120 python3 benchmarks/step_profile.py \
          "$OUT/step_onelaunch$ol.json" --contexts 8192,131072 2>&1 | grep '^T=' \
          | tee -a "$OUT/step.log"
      done ;;
    ncu)
      timeout 150 ncu --clock-control none --profile-from-start off --csv \
        --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__cycles_elapsed.max \
        python3 benchmarks/step_profile.py "$OUT/step_ncu.json" --contexts 131072 --sets 2 \
        --ncu-steps 3 > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
      python3 benchmarks/ncu_summary.py "$OUT/ncu.csv" 1 | tee "$OUT/ncu_summary.txt" ;;
    select)
      for so in 1 0; do
        MLX_QSA_SELECT_ONE_LAUNCH=$so timeout 100 ncu --clock-control none --cache-control none \
          --profile-from-start off --csv --metrics gpu__time_duration.sum \
          python3 benchmarks/step_profile.py "$OUT/y$so.json" --contexts 8192,32768,65536,131072 \
          --sets 2 --ncu-steps 3 > "$OUT/ncu_select$so.csv" 2>/dev/null
        python3 benchmarks/ncu_summary.py "$OUT/ncu_select$so.csv" 4 | tee -a "$OUT/select.log"
        MLX_QSA_SELECT_ONE_LAUNCH=$so timeout 100 python3 benchmarks/step_profile.py \
          "$OUT/step_select$so.json" --contexts 8192,32768,65536,131072 2>&1 | grep '^T=' \
          | tee -a "$OUT/select.log"
      done ;;
    ab)
      for tree in "$OLD" "$NEW" "$OLD" "$NEW"; do
        echo "== $tree" | tee -a "$OUT/ab.log"
        PYTHONPATH="$PWD/$tree:$PYTHONPATH" timeout 100 python3 benchmarks/step_profile.py \
          "$OUT/ab_$(echo $tree | tr / _).json" --contexts 8192,131072 2>&1 | grep '^T=' \
          | tee -a "$OUT/ab.log"
      done ;;
    ab2)  # one pass each, rows 1 and 4, fewer sets
      for tree in "$OLD" "$NEW"; do
        echo "== $tree" | tee -a "$OUT/ab.log"
        PYTHONPATH="$PWD/$tree:$PYTHONPATH" timeout 100 python3 benchmarks/step_profile.py \
          "$OUT/ab2_$(echo $tree | tr / _).json" --contexts 8192,131072 --rows 1,4 --sets 4 \
          2>&1 | grep '^T=' | tee -a "$OUT/ab.log"
      done ;;
    ktests)
      timeout 240 python3 -m pytest -o addopts= -q -x -rs -p no:cacheprovider \
        tests/test_cuda_decode.py "tests/test_cuda_layer.py::test_concurrent_calls_of_one_compiled_graph_use_their_own_counters" \
        2>&1 | tee "$OUT/ktests.log" | tail -6
      rc=$((rc | PIPESTATUS[0])) ;;
    warm)
      for ol in 1 0; do
        MLX_QSA_ONE_LAUNCH=$ol MLX_QSA_SELECT_ONE_LAUNCH=$ol timeout 100 ncu --clock-control none \
          --cache-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \
          python3 benchmarks/step_profile.py "$OUT/w$ol.json" --contexts 8192,131072 --sets 2 \
          --ncu-steps 3 > "$OUT/ncu_warm$ol.csv" 2>/dev/null
        python3 benchmarks/ncu_summary.py "$OUT/ncu_warm$ol.csv" 2 | tee -a "$OUT/warm.log"
      done ;;
    split)
      for sh in 1 0; do
        MLX_QSA_SELECT_ONE_LAUNCH=1 MLX_QSA_SELECT_SPLIT_HEADS=$sh timeout 100 ncu --clock-control none \
          --cache-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \
          python3 benchmarks/step_profile.py "$OUT/z$sh.json" --contexts 8192,131072,262144 \
          --sets 2 --ncu-steps 3 > "$OUT/ncu_split$sh.csv" 2>/dev/null
        python3 benchmarks/ncu_summary.py "$OUT/ncu_split$sh.csv" 3 | tee -a "$OUT/split.log"
      done
      if [ -z "${SPLIT_NCU_ONLY:-}" ]; then
        for sh in 1 0; do
          MLX_QSA_SELECT_ONE_LAUNCH=1 MLX_QSA_SELECT_SPLIT_HEADS=$sh timeout 100 python3 \
            benchmarks/step_profile.py "$OUT/step_split$sh.json" --contexts 8192,131072,262144 \
            2>&1 | grep '^T=' | sed "s/^/split=$sh /" | tee -a "$OUT/split.log"
        done
      fi ;;
    rows)
      timeout 120 ncu --clock-control none --cache-control none --profile-from-start off --csv \
        --metrics gpu__time_duration.sum python3 benchmarks/step_profile.py "$OUT/r.json" \
        --contexts 131072 --rows 1,2,4,8 --sets 2 --ncu-steps 3 > "$OUT/ncu_rows.csv" 2>/dev/null
      python3 benchmarks/ncu_summary.py "$OUT/ncu_rows.csv" 4 | tee -a "$OUT/rows.log"
      timeout 120 python3 benchmarks/step_profile.py "$OUT/step_rows.json" --contexts 131072 \
        --rows 1,2,4,8 2>&1 | grep '^T=' | tee -a "$OUT/rows.log" ;;
    sass)
      ncu --help | grep -iE "print-source|--page|import-source" > "$OUT/ncu_help.txt"
      MLX_QSA_ONE_LAUNCH=0 MLX_QSA_SELECT_ONE_LAUNCH=0 timeout 150 ncu --clock-control none \
        --cache-control none --profile-from-start off -k "regex:topk|score" -c 2 \
        --section WarpStateStats --section SourceCounters --page source --print-source sass \
        --csv python3 benchmarks/step_profile.py "$OUT/s.json" --contexts 131072 --sets 2 \
        --ncu-steps 1 > "$OUT/ncu_sass.csv" 2> "$OUT/ncu_sass.err"
      rm -f "$OUT/s.json"
      wc -l "$OUT/ncu_sass.csv"; tail -3 "$OUT/ncu_sass.err"; head -c 1500 "$OUT/ncu_sass.csv" ;;
    graphsab)
      for g in 1 0 1 0; do
        MLX_USE_CUDA_GRAPHS=$g timeout 100 python3 benchmarks/step_profile.py "$OUT/g.json" \
          --contexts 8192,131072 --rows 1,4 --sets 4 2>&1 | grep '^T=' | sed "s/^/graphs=$g /" \
          | tee -a "$OUT/graphsab.log"
      done
      rm -f "$OUT/g.json" ;;
    topksass)
      MLX_QSA_ONE_LAUNCH=0 MLX_QSA_SELECT_ONE_LAUNCH=0 timeout 150 ncu --clock-control none \
        --cache-control none --profile-from-start off -k "regex:topk" -c 3 \
        --warp-sampling-interval 0 --section WarpStateStats --section SourceCounters --page source \
        --print-source sass --csv python3 benchmarks/step_profile.py "$OUT/s.json" \
        --contexts 131072 --sets 2 --ncu-steps 3 > "$OUT/ncu_topk_sass.csv" 2> "$OUT/ncu_topk.err"
      rm -f "$OUT/s.json"
      python3 benchmarks/ncu_sass_summary.py "$OUT/ncu_topk_sass.csv" 2>&1 | head -60 \
        | tee "$OUT/topk_sass_summary.txt" ;;
    posab)
      for pp in "" --pos-pad; do
        MLX_QSA_ONE_LAUNCH=0 MLX_QSA_SELECT_ONE_LAUNCH=0 timeout 100 ncu --clock-control none \
          --cache-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \
          python3 benchmarks/step_profile.py "$OUT/p.json" --contexts 8192,131072 --sets 2 \
          --ncu-steps 3 $pp > "$OUT/ncu_pos${pp}.csv" 2>/dev/null
        echo "== positions ${pp:-as made}" | tee -a "$OUT/posab.log"
        python3 benchmarks/ncu_summary.py "$OUT/ncu_pos${pp}.csv" 2 | tee -a "$OUT/posab.log"
      done
      for pp in "" --pos-pad "" --pos-pad; do
        timeout 100 python3 benchmarks/step_profile.py "$OUT/p.json" --contexts 8192,131072 $pp \
          2>&1 | grep '^T=' | sed "s/^/pos${pp:-} /" | tee -a "$OUT/posab.log"
      done
      rm -f "$OUT/p.json" ;;
    kab)
      for tree in "$OLD" "$NEW" "$OLD" "$NEW"; do
        for ol in 1 0; do
          PYTHONPATH="$PWD/$tree:$PYTHONPATH" MLX_QSA_ONE_LAUNCH=$ol MLX_QSA_SELECT_ONE_LAUNCH=$ol \
            timeout 100 ncu --clock-control none --cache-control none --profile-from-start off \
            --csv --metrics gpu__time_duration.sum python3 benchmarks/step_profile.py "$OUT/k.json" \
            --contexts 8192,131072 --sets 2 --ncu-steps 3 > "$OUT/ncu_k.csv" 2>/dev/null
          echo "== $tree one_launch=$ol" | tee -a "$OUT/kab.log"
          python3 benchmarks/ncu_summary.py "$OUT/ncu_k.csv" 2 | tee -a "$OUT/kab.log"
        done
      done
      rm -f "$OUT/k.json" "$OUT/ncu_k.csv" ;;
    managed)
      timeout 120 python3 benchmarks/managed_read_ab.py "$OUT/managed_read.json" 2>&1 \
        | tee "$OUT/managed.log"
      timeout 150 ncu --clock-control none --cache-control none --csv \
        --metrics gpu__time_duration.sum python3 benchmarks/managed_read_ab.py --ncu \
        > "$OUT/ncu_managed.csv" 2>/dev/null
      python3 benchmarks/managed_read_ab.py --ncu-report "$OUT/ncu_managed.csv" \
        | tee -a "$OUT/managed.log" ;;
    layerab)
      for tree in "$OLD" "$NEW" "$OLD" "$NEW"; do
        echo "== $tree" | tee -a "$OUT/layerab.log"
        PYTHONPATH="$PWD/$tree:$PYTHONPATH" timeout 150 python3 benchmarks/layer_profile.py \
          "$OUT/l.json" --contexts 8192,131072 2>&1 | grep '^T=' | tee -a "$OUT/layerab.log"
      done
      rm -f "$OUT/l.json" ;;
    layerab8)  # 8 rounds of old / new at 128K, 1 row: the host drifts within a call, so the
      # comparison is per round (each round's two processes run back to back)
      for i in 1 2 3 4 5 6 7 8; do
        for tree in "$OLD" "$NEW"; do
          PYTHONPATH="$PWD/$tree:$PYTHONPATH" timeout 60 python3 benchmarks/layer_profile.py \
            "$OUT/l.json" --contexts 131072 2>&1 | grep '^T=' | sed "s|^|$i $tree |" \
            | tee -a "$OUT/layerab8.log"
        done
      done
      rm -f "$OUT/l.json"
      python3 benchmarks/ab_rounds.py "$OUT/layerab8.log" "$OLD" "$NEW" | tee "$OUT/layerab8_summary.txt" ;;
    topkncu)
      MLX_QSA_ONE_LAUNCH=0 MLX_QSA_SELECT_ONE_LAUNCH=0 timeout 120 ncu --clock-control none --cache-control none \
        --profile-from-start off -k "regex:topk|partial|score" -c 3 --section SourceCounters \
        --section WarpStateStats --section LaunchStats --section Occupancy --import-source yes \
        python3 benchmarks/step_profile.py "$OUT/t.json" --contexts 131072 --sets 2 \
        --ncu-steps 1 > "$OUT/ncu_topk.txt" 2>&1
      grep -v "^==PROF==" "$OUT/ncu_topk.txt" | tail -40 ;;
    *) echo "unknown step $what"; rc=1 ;;
  esac
done
exit $rc
