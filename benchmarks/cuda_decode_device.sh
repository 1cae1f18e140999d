#!/usr/bin/env bash
# GPU machine only (after `source .device/part-b/activate.sh`): runs the CUDA decode-kernel tests,
# then times the kernels with the method of PERFORMANCE.md §7 (warm-up, >= 8 rotated cache sets
# whose total exceeds 2x L2, median of 7 samples with min/max) and prints a table.
# Usage: bash benchmarks/cuda_decode_device.sh [--no-tests] [--no-bench] [--ncu]; results under $OUT.
# Columns: 'step' = selection + attention with one mx.eval per step (host round trip included);
# 'batch8' = 8 steps over 8 caches in one mx.eval, per step; --ncu adds per-kernel device times
# (Nsight Compute, clocks untouched, L2 flushed before each kernel).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/qsa-out}"
mkdir -p "$OUT"
run_tests=1
run_bench=1
run_ncu=0
for a in "$@"; do
  case "$a" in
    --no-tests) run_tests=0 ;;
    --no-bench) run_bench=0 ;;
    --ncu) run_ncu=1 ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
rc=0
if [ "$run_tests" = 1 ]; then
  python3 -m pytest tests/test_cuda_decode.py -q -rfE -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$run_bench" = 1 ]; then
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/timing.txt"
import json, math, os, statistics, sys, time, datetime, platform
import mlx.core as mx
from mlx_qsa.kernels.selector import select_blocks_cuda, select_blocks_portable
from mlx_qsa.kernels.flash_decode import flash_decode_cuda, flash_decode_portable
from mlx_qsa.kernels.rows_gather import rows_gather_cuda

out_dir = sys.argv[1]
L2 = 60e6
H, HKV, D, HI, K = 24, 2, 256, 4, 512
N_ITER, N_SAMPLES = 20, 7


def bucket(n):
    return max(256, 1 << max(0, (n - 1).bit_length()))


def timeit_batch(step, n_sets, batch=8, n_iter=5, n_samples=N_SAMPLES):
    for i in range(2):
        mx.eval([step((i * batch + j) % n_sets) for j in range(batch)])
    mx.synchronize()
    samples = []
    for s in range(n_samples):
        t0 = time.perf_counter()
        for i in range(n_iter):
            mx.eval([step(((s * n_iter + i) * batch + j) % n_sets) for j in range(batch)])
        mx.synchronize()
        samples.append((time.perf_counter() - t0) / (n_iter * batch) * 1e6)
    return statistics.median(samples), min(samples), max(samples)


def host_time(step, n_sets, n=40, n_samples=5):
    """Python + graph building per step (no evaluation inside the timed region)."""
    samples = []
    for s in range(n_samples):
        t0 = time.perf_counter()
        outs = [step((s * n + i) % n_sets) for i in range(n)]
        samples.append((time.perf_counter() - t0) / n * 1e6)
        mx.eval(outs)
        del outs
    mx.synchronize()
    return statistics.median(samples), min(samples), max(samples)


def timeit(step, n_sets, n_iter=N_ITER, n_samples=N_SAMPLES):
    for i in range(3):
        mx.eval(step(i % n_sets))
    mx.synchronize()
    samples = []
    for s in range(n_samples):
        t0 = time.perf_counter()
        for i in range(n_iter):
            mx.eval(step((s * n_iter + i) % n_sets))
        mx.synchronize()
        samples.append((time.perf_counter() - t0) / n_iter * 1e6)
    return statistics.median(samples), min(samples), max(samples)


# device copy bandwidth (read + write)
a = mx.random.normal((256 * 1024 * 1024,))  # 1 GiB float32
mx.eval(a)
copy_t = timeit(lambda i: a + 1.0, 1, n_iter=10, n_samples=5)
copy_bw = 2 * a.nbytes / (copy_t[0] * 1e-6)
del a
print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (1 GiB float32, read + write)")

rows_list = [1, 2, 4, 8]
results = []
for ctx in [8192, 32768, 131072]:
    T = ctx
    nb = T // 4
    cap_pool = bucket(nb)
    cap_kv = -(-T // 256) * 256
    set_bytes = 2 * HKV * cap_kv * D * 2 + cap_pool * 128 * 2
    n_sets = max(8, math.ceil(3 * L2 / set_bytes))
    sets = []
    for s in range(n_sets):
        pooled = mx.random.normal((1, cap_pool, 128)).astype(mx.bfloat16)
        keys = mx.random.normal((1, HKV, cap_kv, D)).astype(mx.bfloat16)
        values = mx.random.normal((1, HKV, cap_kv, D)).astype(mx.bfloat16)
        iq = mx.random.normal((8, HI, 128)).astype(mx.bfloat16)
        q = mx.random.normal((1, H, 8, D)).astype(mx.bfloat16)
        mx.eval(pooled, keys, values, iq, q)
        sets.append((pooled, keys, values, iq, q))
    tarr = mx.array([T], dtype=mx.int32)
    for rows in rows_list:
        pos = mx.array([T - rows + i for i in range(rows)], dtype=mx.int32)
        mode = "blocks" if rows == 1 else "row_tokens"

        def sel(i):
            p, k, v, iq, q = sets[i]
            return select_blocks_cuda(iq[:rows], p, pos, mode=mode)

        pre = [sel(i) for i in range(n_sets)]
        mx.eval(pre)

        if rows == 1:
            qs = [s[4][:, :, :1] for s in sets]
            mx.eval(qs)

            def attn(i, r=None):
                p, k, v, iq, q = sets[i]
                ids, ok = (r or pre[i])[0][0], (r or pre[i])[1][0]
                return flash_decode_cuda(qs[i], k, v, ids, ok, tarr, scale=1 / 16)
        else:
            qs = [s[4][:, :, :rows] for s in sets]
            mx.eval(qs)

            def attn(i, r=None):
                p, k, v, iq, q = sets[i]
                r = r or pre[i]
                return rows_gather_cuda(qs[i], k, v, r[3], r[4], scale=1 / 16)

        t_step = timeit(lambda i: attn(i, sel(i)), n_sets)
        t_batch = timeit_batch(lambda i: attn(i, sel(i)), n_sets)
        t_host = host_time(lambda i: attn(i, sel(i)), n_sets)
        t_sel = timeit(lambda i: sel(i)[0], n_sets)
        t_attn = timeit(attn, n_sets)
        floor_bytes = nb * 128 * 2 + rows * (4 * K + 3) * HKV * 2 * D * 2
        rec = dict(ctx=ctx, rows=rows, step_us=t_step, batch8_us=t_batch, host_us=t_host, select_us=t_sel, attn_us=t_attn,
                   floor_bytes=floor_bytes, floor_us=floor_bytes / copy_bw * 1e6, n_sets=n_sets)
        if rows == 1:
            def port(i):
                p, k, v, iq, q = sets[i]
                r = select_blocks_portable(iq[:1], p, pos)
                return flash_decode_portable(qs[i], k, v, r[0][0], r[1][0], tarr, scale=1 / 16)
            rec["portable_step_us"] = timeit(port, n_sets, n_iter=3, n_samples=3)
        results.append(rec)
        print(json.dumps(rec), flush=True)
    del sets, pre

dev = mx.device_info() if hasattr(mx, "device_info") else {}
meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), mlx=mx.__version__,
            device=str(dev.get("device_name", "")), copy_bw_Bps=copy_bw,
            env={k: os.environ.get(k) for k in ("MLX_ENABLE_TF32", "MLX_USE_CUDA_GRAPHS")},
            method="perf_counter over 20 iterations (each mx.eval), median/min/max of 7 samples",
            results=results)
with open(os.path.join(out_dir, "cuda_decode_timing.json"), "w") as f:
    json.dump(meta, f, indent=1)
print()
print(f"device {meta['device']}  mlx {mx.__version__}  {meta['date']}  copy {copy_bw/1e12:.2f} TB/s")
print(f"{'ctx':>7} {'rows':>4} | {'step us (median min max)':>23} | {'batch8':>7} | {'host':>6} | {'select us':>9} "
      f"| {'attn us':>8} | {'floor us':>8} | {'b8/floor':>7} | {'portable':>10}")
for r in results:
    m, lo, hi = r["step_us"]
    port = f"{r['portable_step_us'][0]:10.1f}" if "portable_step_us" in r else " " * 10
    print(f"{r['ctx']:>7} {r['rows']:>4} | {m:7.1f} {lo:7.1f} {hi:7.1f} | {r['batch8_us'][0]:7.1f} "
          f"| {r['host_us'][0]:6.1f} | {r['select_us'][0]:9.1f} "
          f"| {r['attn_us'][0]:8.1f} | {r['floor_us']:8.2f} | {r['batch8_us'][0] / r['floor_us']:7.1f} "
          f"| {port}")
PY
fi
if [ "$run_ncu" = 1 ]; then
  NDIR=/tmp/qsa-ncu; mkdir -p $NDIR
  cat > "$NDIR/ncu_prof.py" <<'PY'
import sys
import mlx.core as mx
from mlx_qsa.kernels.selector import select_blocks_cuda
from mlx_qsa.kernels.flash_decode import flash_decode_cuda
from mlx_qsa.kernels.rows_gather import rows_gather_cuda
ctx, rows = int(sys.argv[1]), int(sys.argv[2])
nb = ctx // 4
cap_pool = max(256, 1 << (nb - 1).bit_length())
cap_kv = -(-ctx // 256) * 256
pooled = mx.random.normal((1, cap_pool, 128)).astype(mx.bfloat16)
keys = mx.random.normal((1, 2, cap_kv, 256)).astype(mx.bfloat16)
values = mx.random.normal((1, 2, cap_kv, 256)).astype(mx.bfloat16)
iq = mx.random.normal((rows, 4, 128)).astype(mx.bfloat16)
q = mx.random.normal((1, 24, rows, 256)).astype(mx.bfloat16)
pos = mx.array([ctx - rows + i for i in range(rows)], dtype=mx.int32)
tarr = mx.array([ctx], dtype=mx.int32)
for _ in range(3):
    if rows == 1:
        ids, ok, sc = select_blocks_cuda(iq, pooled, pos)
        out = flash_decode_cuda(q, keys, values, ids[0], ok[0], tarr, scale=1 / 16)
    else:
        r = select_blocks_cuda(iq, pooled, pos, mode="row_tokens")
        out = rows_gather_cuda(q, keys, values, r[3], r[4], scale=1 / 16)
    mx.eval(out)
PY
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for cfg in "32768 1" "131072 1" "131072 4" "131072 8"; do
    set -- $cfg
    MLX_USE_CUDA_GRAPHS=0 timeout 120 "$NCU" --clock-control none --cache-control all -k regex:qsa_ \
      --metrics gpu__time_duration.sum,gpc__cycles_elapsed.max,gpc__cycles_elapsed.avg.per_second --csv python3 "$NDIR/ncu_prof.py" $1 $2 \
      > "$NDIR/ncu_$1_$2.csv" 2> "$NDIR/ncu_$1_$2.err"
    echo "ncu ctx $1 rows $2 rc $?" | tee -a "$OUT/ncu.txt"
    tail -3 "$NDIR/ncu_$1_$2.err"
    python3 - "$NDIR/ncu_$1_$2.csv" <<'PY' | tee -a "$OUT/ncu.txt"
import csv, re, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    print("  no ncu rows"); sys.exit()
hdr = rows[0]
ii, ki = hdr.index("ID"), hdr.index("Kernel Name")
ni, ui, vi = hdr.index("Metric Name"), hdr.index("Metric Unit"), hdr.index("Metric Value")
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
launch = collections.defaultdict(dict)
for r in rows[1:]:
    v = float(r[vi].replace(",", ""))
    d = launch[r[ii]]
    m = re.search(r"qsa_([a-z]+)_", r[ki])
    d["name"] = m.group(1) if m else r[ki][:30]
    if r[ni] == "gpu__time_duration.sum":
        d["us"] = v * scale.get(r[ui], float("nan"))
    elif r[ni] == "gpc__cycles_elapsed.max":
        d["cyc"] = v
    else:
        d["hz"] = v * {"hz": 1, "khz": 1e3, "mhz": 1e6, "ghz": 1e9}.get(r[ui].lower(), 1.0)
acc = collections.defaultdict(list)
for d in launch.values():
    acc[d["name"]].append(d)
def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]
tot = tot_est = 0.0
for k, ds in acc.items():
    us = med([d.get("us", float("nan")) for d in ds])
    cyc = med([d.get("cyc", float("nan")) for d in ds])
    hz = med([d.get("hz", float("nan")) for d in ds])
    est = cyc / 1980.0
    tot += us
    tot_est += est
    print(f"  {k:8s} {us:8.2f} us  {cyc:9.0f} cycles at {hz / 1e6:7.1f} MHz -> {est:6.2f} us "
          f"at 1980 MHz  ({len(ds)} launches)")
print(f"  sum of medians {tot:.2f} us; at 1980 MHz {tot_est:.2f} us")
PY
  done
fi
exit $rc
