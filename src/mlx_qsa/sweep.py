"""`mlx-qsa sweep`: GEMM tile sweep in the reference schema (SWEEP.md).

Times the custom CUDA GEMM (`kernels/gemm.py`) over a grid of tile configurations against MLX's
built-in `mx.addmm` for one projection operator, checks every custom output against the
built-in one, and writes one JSON document in exactly the schema of
`tests/data/qkv_tile_sweep_m5pro.json`. On a machine without CUDA only the baseline runs.

Extra information that the schema has no place for goes in one top-level key `"extra"` placed
after `"trials"` (left out with `--no-extra`, and absent when it would be empty):
`peers` (torch `F.linear` with bias on the same inputs, timed like the trials, plus CUDA-event
samples), `plans` (each custom trial's kernel family, pipeline stages, warp layout and shared
memory) and `left_out` (configurations that could not run, with the reason).

MLX reads its precision variables when it loads, so this module sets them (if unset) on import
and imports MLX only inside functions.
"""

from __future__ import annotations

import os

PRECISION_VARIABLES = ("MLX_ENABLE_TF32", "MLX_CONV_WINOGRAD")
# Variables that change timings but not results: recorded in "extra" beside the timings they
# shaped (PERFORMANCE.md §7.6); null where unset (MLX's default applies).
TIMING_VARIABLES = ("MLX_USE_CUDA_GRAPHS",)
PEER_NAME = "torch"  # the peer's key in time_steady's rotation
for _name in PRECISION_VARIABLES:
    os.environ.setdefault(_name, "0")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from importlib import metadata  # noqa: E402
from typing import Any  # noqa: E402

from mlx_qsa.kernels.gemm import FAMILIES, plan_gemm  # noqa: E402  (imports no MLX)
from mlx_qsa.turns import take_turns  # noqa: E402

# operator -> (N, K) (SWEEP.md §1)
OPERATORS: dict[str, tuple[int, int]] = {
    "attn.qkv_proj": (13312, 2560),
    "attn.qkvi_proj": (13952, 2560),
    "attn.o_proj": (2560, 6144),
    "indexer.qk_proj": (640, 2560),
}

# The fixture's grid: (tile, warps per block); each runs with walk_m 0 then 8.
DEFAULT_GRID: tuple[tuple[tuple[int, int, int], int], ...] = (
    ((32, 64, 128), 2),
    ((32, 64, 256), 2),
    ((64, 64, 128), 4),
    ((64, 64, 256), 4),
    ((64, 128, 128), 4),
    ((64, 128, 256), 4),
    ((128, 64, 128), 4),
    ((128, 64, 256), 4),
    ((128, 128, 128), 4),
    ((128, 128, 256), 4),
    ((128, 128, 128), 8),
    ((128, 128, 256), 8),
    ((64, 128, 128), 8),
    ((64, 128, 256), 8),
)
DEFAULT_WALKS: tuple[int, ...] = (0, 8)

VERSION_PACKAGES = (
    "mlx",
    "mlx-metal",
    "mlx-cuda-13",
    "mlx-cpu",
    "numpy",
    "safetensors",
    "transformers",
    "torch",
    "Pillow",
    "scikit-image",
    "mlx-qsa",
)
DEVICE_KEYS = (
    "device_name",
    "max_recommended_working_set_size",
    "memory_size",
    "architecture",
    "max_buffer_length",
    "resource_limit",
)
RMSE_LIMIT = 1e-2  # the pass criterion for every custom trial
BASELINE_TILE = (0, 0, 0)


# ---- pure helpers -------------------------------------------------------------------------


def parse_shape(text: str) -> tuple[int, int]:
    """`"K,N"` -> (K, N), both positive."""
    parts = text.split(",")
    try:
        k, n = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--shape: expected K,N (two integers), got {text!r}") from None
    if k < 1 or n < 1:
        raise ValueError(f"--shape: K and N must be >= 1, got {text!r}")
    return k, n


def parse_tiles(text: str) -> list[tuple[tuple[int, int, int], int]]:
    """`"default"` or comma-separated `TMxTNxTK/WARPS` entries (e.g. `128x256x64/8`)."""
    if text.strip() == "default":
        return list(DEFAULT_GRID)
    configs = []
    for item in text.split(","):
        item = item.strip()
        try:
            dims, warps = item.split("/")
            tm, tn, tk = (int(v) for v in dims.lower().split("x"))
            configs.append(((tm, tn, tk), int(warps)))
        except ValueError:
            raise ValueError(
                f"--tiles: expected 'default' or entries TMxTNxTK/WARPS, got {item!r}"
            ) from None
    if not configs:
        raise ValueError("--tiles: no configuration given")
    return configs


def parse_walks(text: str) -> list[int]:
    try:
        walks = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--walk-m: expected comma-separated integers, got {text!r}") from None
    if any(w < 0 for w in walks):
        raise ValueError(f"--walk-m: values must be >= 0, got {text!r}")
    return walks


def expand_grid(
    configs: list[tuple[tuple[int, int, int], int]] | tuple, walks: list[int] | tuple
) -> list[tuple[tuple[int, int, int], int, int]]:
    """(tile, warps) x walk_m in the schema's trial order: each configuration, walks in order."""
    return [(tile, warps, walk) for tile, warps in configs for walk in walks]


def agreement(reference, output) -> tuple[float, float, float]:
    """(max_abs, relative_rmse, equal_fraction) of `output` against `reference` (SWEEP.md §5).

    Both are float32 NumPy arrays holding bf16 values; reductions run in float64.
    """
    import numpy as np

    r32 = np.asarray(reference, dtype=np.float32)
    c32 = np.asarray(output, dtype=np.float32)
    if r32.shape != c32.shape:
        raise ValueError(f"agreement: shapes differ, {r32.shape} vs {c32.shape}")
    if r32.size == 0:
        return 0.0, 0.0, 1.0
    r = r32.astype(np.float64).ravel()
    d = c32.astype(np.float64).ravel() - r
    max_abs = float(np.max(np.abs(d)))
    num = math.sqrt(float(np.dot(d, d)) / d.size)
    den = math.sqrt(float(np.dot(r, r)) / r.size)
    rmse = num / den if den > 0 else num
    equal = float(np.count_nonzero(c32 == r32)) / r32.size
    return max_abs, rmse, equal


def serialize(doc: dict) -> str:
    """The reference serialization: one line, a space inside every bracket, no newline at end."""
    return json.dumps(doc, indent=0).replace("\n", " ")


def timing_fields(samples: list[float]) -> dict[str, Any]:
    return {
        "median_ms": statistics.median(samples),
        "min_ms": min(samples),
        "max_ms": max(samples),
        "samples_ms": list(samples),
    }


def _fmt_config(trial: dict) -> str:
    tile = trial["tile"]
    return f"[{tile[0]},{tile[1]},{tile[2]}]/{trial['simdgroups']}/{trial['walk_m']}"


def _config_key(trial: dict) -> tuple:
    return (tuple(trial["tile"]), trial["simdgroups"], trial["walk_m"])


def summarize(doc: dict) -> dict[str, Any]:
    """Baseline, best and worst custom trial, ratios to the baseline, agreement counts."""
    trials = doc["trials"]
    base = next((t for t in trials if tuple(t["tile"]) == BASELINE_TILE), None)
    if base is None:
        raise ValueError("sweep document has no baseline trial (tile [0, 0, 0])")
    custom = [t for t in trials if tuple(t["tile"]) != BASELINE_TILE]
    env = doc["environment"]
    backend = next((k for k in ("cuda", "metal", "cpu") if k in env), None)
    device = env[backend].get("device_name") if backend else None
    out: dict[str, Any] = {
        "device": f"{device} ({backend})" if backend else "?",
        "operator": base["operator"],
        "tokens": base["tokens"],
        "warmup": doc["warmup"],
        "repeats": doc["repeats"],
        "baseline": base,
        "custom": custom,
        "best": min(custom, key=lambda t: t["median_ms"]) if custom else None,
        "worst": max(custom, key=lambda t: t["median_ms"]) if custom else None,
        "identical": sum(1 for t in custom if t["max_abs"] == 0.0 and t["equal_fraction"] == 1.0),
        "max_rmse": max((t["relative_rmse"] for t in custom), default=None),
        "peer": None,
    }
    peers = doc.get("extra", {}).get("peers", [])
    if peers:
        out["peer"] = peers[0]
    # extra.steady (sweep --steady: per-call throughput) and extra.paired (sweep --paired: many
    # interleaved one-call samples): the baseline and the fastest entry of each.
    for kind in ("steady", "paired"):
        entries = doc.get("extra", {}).get(kind, {}).get("entries", [])
        out[f"{kind}_baseline"] = next((e for e in entries if e["config"] == "baseline"), None)
        out[f"{kind}_best"] = min(
            (e for e in entries if e["config"] != "baseline"),
            key=lambda e: e["median_ms"],
            default=None,
        )
    return out


def compare_text(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> str:
    """Two sweeps side by side: best configuration and ratios to each sweep's own baseline."""
    sa, sb = summarize(a), summarize(b)

    def ratio(t: dict | None, s: dict, field: str = "median_ms") -> str:
        if t is None:
            return "-"
        return f"{t[field] / s['baseline'][field]:.4f}"

    def ms(t: dict | None, field: str = "median_ms") -> str:
        return "-" if t is None else f"{t[field]:.3f}"

    def peer_ratio(s: dict) -> str:
        if s["peer"] is None or s["best"] is None:
            return "-"
        return f"{s['best']['median_ms'] / s['peer']['median_ms']:.4f}"

    def peer_has(s: dict, field: str) -> bool:
        return s["peer"] is not None and field in s["peer"]

    def peer_ms(s: dict, field: str) -> str:
        """A figure of the torch peer, or '-' where the document has none."""
        return ms(s["peer"], field) if peer_has(s, field) else "-"

    def best_ratio(s: dict, kind: str, torch: bool = False) -> str:
        best = s[f"{kind}_best"]
        if best is None or s[f"{kind}_baseline"] is None:
            return "-"
        if torch and not peer_has(s, f"{kind}_median_ms"):
            return "-"
        ref = s["peer"][f"{kind}_median_ms"] if torch else s[f"{kind}_baseline"]["median_ms"]
        return f"{best['median_ms'] / ref:.4f}"

    def block_rows(kind: str) -> list[tuple[str, str, str]]:
        """The baseline, the fastest entry and their ratio in extra.steady or extra.paired, and
        the torch peer's figures of the same rotation."""
        return [
            (f"{kind} baseline ms", ms(sa[f"{kind}_baseline"]), ms(sb[f"{kind}_baseline"])),
            (
                f"{kind} best custom",
                sa[f"{kind}_best"]["config"] if sa[f"{kind}_best"] else "-",
                sb[f"{kind}_best"]["config"] if sb[f"{kind}_best"] else "-",
            ),
            (f"{kind} best ms", ms(sa[f"{kind}_best"]), ms(sb[f"{kind}_best"])),
            (f"{kind} best / baseline", best_ratio(sa, kind), best_ratio(sb, kind)),
            # torch's rounds in the same rotation: CUDA events, then wall clock
            (
                f"{kind} torch ms",
                peer_ms(sa, f"{kind}_median_ms"),
                peer_ms(sb, f"{kind}_median_ms"),
            ),
            (f"{kind} best / torch", best_ratio(sa, kind, True), best_ratio(sb, kind, True)),
            (
                f"{kind} torch wall ms",
                peer_ms(sa, f"{kind}_wall_median_ms"),
                peer_ms(sb, f"{kind}_wall_median_ms"),
            ),
        ]

    rows = [
        ("sweep", f"A: {names[0]}", f"B: {names[1]}"),
        ("device", sa["device"], sb["device"]),
        ("operator", sa["operator"], sb["operator"]),
        ("tokens", str(sa["tokens"]), str(sb["tokens"])),
        (
            "warmup / repeats",
            f"{sa['warmup']} / {sa['repeats']}",
            f"{sb['warmup']} / {sb['repeats']}",
        ),
        ("custom trials", str(len(sa["custom"])), str(len(sb["custom"]))),
        ("baseline median ms", ms(sa["baseline"]), ms(sb["baseline"])),
        ("baseline min ms", ms(sa["baseline"], "min_ms"), ms(sb["baseline"], "min_ms")),
        (
            "best custom",
            _fmt_config(sa["best"]) if sa["best"] else "-",
            _fmt_config(sb["best"]) if sb["best"] else "-",
        ),
        ("best median ms", ms(sa["best"]), ms(sb["best"])),
        ("best / baseline median", ratio(sa["best"], sa), ratio(sb["best"], sb)),
        ("best / baseline min", ratio(sa["best"], sa, "min_ms"), ratio(sb["best"], sb, "min_ms")),
        (
            "worst custom",
            _fmt_config(sa["worst"]) if sa["worst"] else "-",
            _fmt_config(sb["worst"]) if sb["worst"] else "-",
        ),
        ("worst / baseline median", ratio(sa["worst"], sa), ratio(sb["worst"], sb)),
        (
            "bit-identical custom",
            f"{sa['identical']}/{len(sa['custom'])}",
            f"{sb['identical']}/{len(sb['custom'])}",
        ),
        (
            "max relative_rmse",
            "-" if sa["max_rmse"] is None else f"{sa['max_rmse']:.3e}",
            "-" if sb["max_rmse"] is None else f"{sb['max_rmse']:.3e}",
        ),
        ("torch F.linear median ms", ms(sa["peer"]), ms(sb["peer"])),
        ("best / torch median", peer_ratio(sa), peer_ratio(sb)),
    ]
    for kind in ("steady", "paired"):
        if sa[f"{kind}_baseline"] or sb[f"{kind}_baseline"]:
            rows += block_rows(kind)
    w0 = max(len(r[0]) for r in rows) + 2
    w1 = max(len(r[1]) for r in rows) + 2
    lines = [f"{r[0]:<{w0}}{r[1]:<{w1}}{r[2]}" for r in rows]

    lines.append("")
    head = ("configuration", "A median ms", "A / base", "B median ms", "B / base")
    keys: list[tuple] = []
    by_a = {_config_key(t): t for t in sa["custom"]}
    by_b = {_config_key(t): t for t in sb["custom"]}
    for t in sa["custom"] + sb["custom"]:
        if _config_key(t) not in keys:
            keys.append(_config_key(t))
    table = [head]
    for key in keys:
        ta, tb = by_a.get(key), by_b.get(key)
        label = f"[{key[0][0]},{key[0][1]},{key[0][2]}]/{key[1]}/{key[2]}"
        table.append((label, ms(ta), ratio(ta, sa), ms(tb), ratio(tb, sb)))
    widths = [max(len(r[i]) for r in table) + 2 for i in range(5)]
    for r in table:
        lines.append("".join(f"{c:<{widths[i]}}" for i, c in enumerate(r)).rstrip())
    return "\n".join(lines)


# ---- MLX side -----------------------------------------------------------------------------


def backend_name() -> str:
    import mlx.core as mx

    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return "cpu"


def device_block(backend: str) -> dict[str, Any]:
    """The six device keys from MLX; keys the backend cannot report are None."""
    import mlx.core as mx

    try:
        info = dict(mx.device_info(mx.cpu if backend == "cpu" else mx.gpu))
    except Exception:  # noqa: BLE001 - a backend without device_info reports nothing
        info = {}
    if "memory_size" not in info and "total_memory" in info:
        info["memory_size"] = info["total_memory"]
    return {k: info.get(k) for k in DEVICE_KEYS}


def versions() -> dict[str, str]:
    out = {}
    for name in VERSION_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def environment(backend: str) -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        backend: device_block(backend),
        "versions": versions(),
        "precision_environment": {k: os.environ.get(k, "") for k in PRECISION_VARIABLES},
    }


def make_inputs(tokens: int, n: int, k: int, seed: int):
    """Synthetic bf16 x (standard normal), W (normal, std K^-1/2) and b (W's law x 0.1)."""
    import mlx.core as mx

    kx, kw, kb = mx.random.split(mx.random.key(seed), 3)
    scale = k**-0.5
    x = mx.random.normal((tokens, k), key=kx).astype(mx.bfloat16)
    w = (mx.random.normal((n, k), key=kw) * scale).astype(mx.bfloat16)
    b = (mx.random.normal((n,), key=kb) * (0.1 * scale)).astype(mx.bfloat16)
    mx.eval(x, w, b)
    return x, w, b


def time_calls(fn, warmup: int, repeats: int):
    """SWEEP.md §3: `warmup` untimed calls, then `repeats` samples of one call + eval + sync."""
    import mlx.core as mx

    y = None
    for _ in range(warmup):
        y = fn()
        mx.eval(y)
        mx.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = fn()
        mx.eval(y)
        mx.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return y, samples


def time_steady(
    calls: dict[str, Any],
    per_round: int,
    rounds: int,
    peers: dict[str, Any] | None = None,
    settle_s: float = 0.0,
) -> dict[str, list[Any]]:
    """Per-call device throughput: `per_round` back-to-back calls, then one synchronize, divided.

    PERFORMANCE.md §7's method: each call ends in `mx.async_eval` of its output, so the GPU
    starts on the first call while the host builds the next (as torch's launches do), and the
    host's work per call overlaps the kernels instead of adding to them. With `per_round` 1
    each sample is one call + `mx.eval` + synchronize, as the schema's (`time_calls`):
    `sweep --paired`.

    All entries take turns, round by round (`turns.take_turns` says why), and so do `peers`
    (name -> a function running one round of that many calls of a peer and returning its own
    measure of it, e.g. torch's CUDA events). After one untimed round of each, untimed rounds
    go on until `settle_s` seconds have passed, so the clocks have settled before any round is
    timed.
    """
    import mlx.core as mx

    def mlx_round(fn) -> float:
        t0 = time.perf_counter()
        if per_round == 1:
            mx.eval(fn())
        else:
            for _ in range(per_round):
                mx.async_eval(fn())
        mx.synchronize()
        return (time.perf_counter() - t0) * 1e3 / per_round

    entries = {name: functools.partial(mlx_round, fn) for name, fn in calls.items()}
    entries |= {name: functools.partial(fn, per_round) for name, fn in (peers or {}).items()}
    return take_turns(entries, rounds, warm_rounds=1, settle_s=settle_s)


def _to_numpy(a):
    import mlx.core as mx
    import numpy as np

    return np.array(a.astype(mx.float32))


def torch_peer(
    x,
    w,
    b,
    warmup: int,
    repeats: int,
    reference,
    operator: str,
    tokens: int,
):
    """torch `F.linear(x, W, b)` on the same bf16 inputs: `(document, steady_round)`, or None
    when torch is missing.

    The document has the one-call samples (as the trials are timed) and, on CUDA, CUDA-event
    samples of one call. `steady_round(calls)` runs `calls` back-to-back calls and returns
    their CUDA-event time per call (PERFORMANCE.md §7's torch measure) and their wall time
    until the synchronize returns (the MLX entries' measure), per call; it is None without
    CUDA. `time_steady` takes it as a peer, `add_round_fields` files its rounds.
    """
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def to_torch(a):
        return torch.from_numpy(_to_numpy(a)).to(dev).to(torch.bfloat16)

    tx, tw, tb = to_torch(x), to_torch(w), to_torch(b)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    out = None
    for _ in range(warmup):
        out = F.linear(tx, tw, tb)
        sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = F.linear(tx, tw, tb)
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)

    def steady_round(calls: int) -> tuple[float, float]:
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(calls):
            F.linear(tx, tw, tb)
        stop.record()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / calls
        return float(start.elapsed_time(stop)) / calls, wall

    events = [steady_round(1)[0] for _ in range(repeats)] if dev == "cuda" else []
    max_abs, rmse, equal = agreement(reference, out.float().cpu().numpy())
    peer: dict[str, Any] = {
        "peer": "torch.nn.functional.linear",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "operator": operator,
        "tokens": tokens,
        "method": "perf_counter around one call + torch.cuda.synchronize(), as the trials",
        **timing_fields(samples),
        "max_abs": max_abs,
        "relative_rmse": rmse,
        "equal_fraction": equal,
    }
    if events:
        peer["event_median_ms"] = statistics.median(events)
        peer["event_samples_ms"] = events
    return peer, (steady_round if dev == "cuda" else None)


def add_round_fields(peer: dict, kind: str, rounds: list[tuple[float, float]]) -> None:
    """File a peer's `(event ms, wall ms)` rounds from `time_steady` as `{kind}_median_ms`
    and `{kind}_samples_ms` (events, PERFORMANCE.md §7) and `{kind}_wall_...` (wall clock, the
    way the MLX entries are timed; events leave out the launch and synchronize costs)."""
    events = [e for e, _ in rounds]
    walls = [w for _, w in rounds]
    peer[f"{kind}_median_ms"] = statistics.median(events)
    peer[f"{kind}_samples_ms"] = events
    peer[f"{kind}_wall_median_ms"] = statistics.median(walls)
    peer[f"{kind}_wall_samples_ms"] = walls


def run_sweep(
    *,
    operator: str,
    n: int,
    k: int,
    tokens: int,
    configs: list[tuple[tuple[int, int, int], int]],
    walks: list[int],
    warmup: int,
    repeats: int,
    stages: int | None = None,
    family: str = "auto",
    seed: int = 0,
    extra: bool = True,
    steady: tuple[int, int] = (0, 0),
    paired: int = 0,
    settle_s: float = 0.0,
    log=None,
) -> dict:
    """Run the baseline and (on CUDA) every custom configuration; return the document.

    `steady = (calls, rounds)` with calls > 0 adds `extra.steady`: each entry's per-call
    throughput (`time_steady`) beside the schema's one-call samples. `paired` > 0 adds
    `extra.paired`: that many one-call samples of every entry, round-robin (`time_steady` with
    one call a round). torch, when importable, takes its turns in both rotations; both start
    after `settle_s` seconds of untimed rounds.
    """
    import mlx.core as mx

    from mlx_qsa.kernels import gemm

    log = sys.stderr if log is None else log
    backend = backend_name()
    x, w, b = make_inputs(tokens, n, k, seed)

    y_ref, samples = time_calls(lambda: gemm.gemm_bias_reference(x, w, b), warmup, repeats)
    reference = _to_numpy(y_ref)
    del y_ref
    trials = [
        {
            "operator": operator,
            "tokens": tokens,
            "tile": list(BASELINE_TILE),
            "simdgroups": 0,
            "walk_m": 0,
            **timing_fields(samples),
            "max_abs": 0.0,
            "relative_rmse": 0.0,
            "equal_fraction": 1.0,
        }
    ]
    print(f"baseline mx.addmm: median {trials[0]['median_ms']:.4f} ms", file=log)
    steady_calls: dict[str, Any] = {"baseline": lambda: gemm.gemm_bias_reference(x, w, b)}

    plans, left_out = [], []
    custom_ran = backend == "cuda"
    if not custom_ran:
        print(
            f"sweep: custom GEMM kernels need MLX with CUDA (backend here: {backend}); "
            "running the baseline only",
            file=log,
        )
    else:
        for tile, warps, walk in expand_grid(configs, walks):
            label = f"[{tile[0]},{tile[1]},{tile[2]}]/{warps}/{walk}"
            try:
                plan = plan_gemm(tile, warps, walk, stages=stages, family=family)

                def call(tile=tile, warps=warps, walk=walk):
                    return gemm.gemm_bias(
                        x, w, b, tile=tile, warps=warps, walk_m=walk, stages=stages, family=family
                    )

                y, samples = time_calls(call, warmup, repeats)
                output = _to_numpy(y)
                del y
            except (NotImplementedError, RuntimeError, ValueError) as err:
                print(f"sweep: left out {label}: {err}", file=log)
                left_out.append(
                    {"tile": list(tile), "simdgroups": warps, "walk_m": walk, "reason": str(err)}
                )
                continue
            max_abs, rmse, equal = agreement(reference, output)
            del output
            trial = {
                "operator": operator,
                "tokens": tokens,
                "tile": list(tile),
                "simdgroups": warps,
                "walk_m": walk,
                **timing_fields(samples),
                "max_abs": max_abs,
                "relative_rmse": rmse,
                "equal_fraction": equal,
            }
            trials.append(trial)
            steady_calls[label] = call
            plans.append(
                {
                    "tile": list(tile),
                    "simdgroups": warps,
                    "walk_m": walk,
                    "family": plan.family,
                    "stages": plan.stages,
                    "layout_m": plan.layout_m,
                    "threads": plan.threads,
                    "consumer_regs": plan.consumer_regs,
                    "cluster": plan.cluster,
                    "shared_memory": plan.shared_memory,
                }
            )
            print(
                f"{label:<20} {plan.family:<5} s{plan.stages} median {trial['median_ms']:.4f} ms "
                f"({trial['median_ms'] / trials[0]['median_ms']:.4f}x baseline) "
                f"rmse {rmse:.2e} equal {equal:.4f}",
                file=log,
            )
            mx.clear_cache()

    peer, peer_round = None, None
    if extra:
        found = torch_peer(x, w, b, warmup, repeats, reference, operator, tokens)
        if found is not None:
            peer, peer_round = found
            print(f"torch F.linear: median {peer['median_ms']:.4f} ms", file=log)
    # torch's rounds take turns with the MLX entries' (time_steady says why)
    peers = {PEER_NAME: peer_round} if peer_round is not None else {}
    rotation = "entries and torch round-robin" if peers else "entries round-robin"
    settle = f"after {settle_s:g} s of untimed rounds, " if settle_s > 0 else ""

    def rotation_doc(kind: str, per_round: int, rounds: int, method: str, **kw) -> dict:
        """extra.steady / extra.paired: the MLX entries' rounds and torch's, in turns."""
        measured = time_steady(steady_calls, per_round, rounds, peers, settle_s)
        if peers:
            add_round_fields(peer, kind, measured.pop(PEER_NAME))
            print(
                f"{kind} torch F.linear {peer[f'{kind}_median_ms']:.4f} ms "
                f"(wall {peer[f'{kind}_wall_median_ms']:.4f} ms)",
                file=log,
            )
        return _round_robin_doc(kind, f"{method}, {settle}{rotation}", measured, log, **kw)

    steady_doc = None
    if extra and steady[0] > 0:
        per_round, rounds = steady
        steady_doc = rotation_doc(
            "steady",
            per_round,
            rounds,
            f"{per_round} back-to-back calls, each ended by mx.async_eval, then one synchronize, "
            f"divided; {rounds} rounds",
        )
    paired_doc = None
    if extra and paired > 0:
        paired_doc = rotation_doc(
            "paired",
            1,
            paired,
            f"{paired} rounds of one call + eval + synchronize per entry",
            quartiles=True,
        )

    doc: dict[str, Any] = {
        "environment": environment(backend),
        "warmup": warmup,
        "repeats": repeats,
        "scope": scope_text(backend, custom_ran, operator, n, k, family, stages),
        "trials": trials,
    }
    extras: dict[str, Any] = {}
    if peer is not None:
        extras["peers"] = [peer]
    if plans:
        extras["plans"] = plans
    if steady_doc is not None:
        extras["steady"] = steady_doc
    if paired_doc is not None:
        extras["paired"] = paired_doc
    if steady_doc is not None or paired_doc is not None:
        extras["timing_variables"] = {v: os.environ.get(v) for v in TIMING_VARIABLES}
    if left_out:
        extras["left_out"] = left_out
    if extra and extras:
        doc["extra"] = extras
    return doc


def _round_robin_doc(
    kind: str, method: str, measured: dict[str, list[float]], log, quartiles: bool = False
) -> dict:
    """extra.steady / extra.paired: each entry's median (and, with `quartiles`, q1 and q3),
    its ratio to the baseline's and its samples; one line per entry to `log`."""
    base = statistics.median(measured["baseline"])
    doc: dict[str, Any] = {"method": method, "entries": []}
    for name, samples in measured.items():
        med = statistics.median(samples)
        entry: dict[str, Any] = {"config": name, "median_ms": med}
        if quartiles:
            q1, _, q3 = statistics.quantiles(samples, n=4) if len(samples) > 1 else (med,) * 3
            entry |= {"q1_ms": q1, "q3_ms": q3}
        doc["entries"].append(entry | {"vs_baseline": med / base, "samples_ms": samples})
        print(f"{kind} {name:<20} {med:.4f} ms ({med / base:.4f}x baseline)", file=log)
    return doc


def scope_text(
    backend: str,
    custom_ran: bool,
    operator: str,
    n: int,
    k: int,
    family: str,
    stages: int | None,
) -> str:
    text = (
        f"Synthetic BF16 weights (normal, std K^-1/2; {operator}: N={n}, K={k}) and synthetic "
        "BF16 inputs (standard normal); synthetic BF16 bias (the weights' law x 0.1), since the "
        "QSA projections have no bias. Baseline mx.addmm (cuBLASLt bias epilogue on CUDA)."
    )
    if custom_ran and family.startswith("tma"):
        clusters = (
            " in clusters of two blocks that share each W tile by TMA multicast"
            if family.startswith("tma_mc")
            else ""
        ) + (
            ", each finished tile staged in shared memory and written by TMA stores"
            if family.endswith("_st")
            else ""
        )
        text += (
            " Custom mx.fast.cuda_kernel GEMMs with FP32 accumulation and BF16 bias epilogue: "
            f"family {family} (persistent grid of one block per SM{clusters}; one producer warp "
            "(a producer warpgroup handing registers to the consumers where the tile needs "
            "them) issuing TMA tile loads into an mbarrier-guarded ring of "
            + ("as many stages as fit, up to 8" if stages is None else f"{stages} stages")
            + "; consumer warpgroups on wgmma m64nNk16, sm_90a), 128-byte swizzled shared memory."
        )
    elif custom_ran:
        text += (
            " Custom mx.fast.cuda_kernel GEMMs with FP32 accumulation and BF16 bias epilogue: "
            f"family {family} (wgmma m64nNk16 on sm_90a where the warps form warpgroups, "
            "else mma.sync m16n8k16), cp.async ring of "
            + ("up to 4 stages" if stages is None else f"{stages} stages")
            + ", 128-byte swizzled shared memory."
        )
    else:
        text += f" Custom kernels need CUDA: baseline only ({backend})."
    return text


# ---- command line -------------------------------------------------------------------------


def _arg(parse):
    def wrapped(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    wrapped.__name__ = parse.__name__
    return wrapped


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise ValueError(f"expected an integer >= 1, got {text}")
    return v


def parse_steady(text: str) -> tuple[int, int]:
    """`--steady`: 'CALLS' or 'CALLSxROUNDS' (rounds default 5); '0' turns it off."""
    calls, _, rounds = text.partition("x")
    try:
        c, r = int(calls), int(rounds or 5)
    except ValueError:
        raise ValueError(f"--steady: expected CALLS or CALLSxROUNDS, got {text!r}") from None
    if c < 0 or r < 1:
        raise ValueError(f"--steady: expected CALLS >= 0 and ROUNDS >= 1, got {text!r}")
    return c, r


def _non_negative(text: str) -> int:
    v = int(text)
    if v < 0:
        raise ValueError(f"expected an integer >= 0, got {text}")
    return v


def _non_negative_seconds(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--op", choices=sorted(OPERATORS), help="projection operator (default attn.qkv_proj)"
    )
    what.add_argument(
        "--shape", type=_arg(parse_shape), metavar="K,N", help="any GEMM shape instead"
    )
    parser.add_argument(
        "--tokens", type=_arg(_positive), default=4181, help="rows M of x (default 4181)"
    )
    parser.add_argument(
        "--tiles",
        type=_arg(parse_tiles),
        default="default",
        help="'default' (the fixture's 14 configurations) or TMxTNxTK/WARPS,... "
        "(e.g. 128x256x64/8)",
    )
    parser.add_argument(
        "--walk-m", type=_arg(parse_walks), default="0,8", help="walk_m values (default 0,8)"
    )
    parser.add_argument(
        "--stages",
        type=_arg(_positive),
        default=None,
        help="cp.async stages (default: as many as fit, at most 4)",
    )
    parser.add_argument("--family", choices=FAMILIES, default="auto", help="custom kernel family")
    parser.add_argument("--warmup", type=_arg(_non_negative), default=2)
    parser.add_argument("--repeats", type=_arg(_positive), default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", metavar="FILE", help="write the JSON here (default: stdout)")
    parser.add_argument("--no-extra", action="store_true", help="write the schema's keys only")
    parser.add_argument(
        "--steady",
        type=_arg(parse_steady),
        default="0",
        metavar="CALLS[xROUNDS]",
        help="also time CALLS back-to-back calls per round (default 5 rounds) for every entry, "
        "into extra.steady (default 0: off)",
    )
    parser.add_argument(
        "--paired",
        type=_arg(_non_negative),
        default=0,
        metavar="ROUNDS",
        help="also take ROUNDS one-call samples of every entry, round-robin, into extra.paired "
        "(default 0: off)",
    )
    parser.add_argument(
        "--settle",
        type=_arg(_non_negative_seconds),
        default=1.0,
        metavar="SECONDS",
        help="untimed round-robin rounds before --steady and --paired time, for at least this "
        "long, so the GPU's clocks settle under the load before any round is timed (default 1)",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        help="print two sweep files side by side and exit",
    )


def run(args: argparse.Namespace) -> int:
    if args.compare:
        docs = []
        for path in args.compare:
            with open(path) as f:
                docs.append(json.load(f))
        names = tuple(os.path.basename(p) for p in args.compare)
        print(compare_text(docs[0], docs[1], names))
        return 0

    tiles = args.tiles if isinstance(args.tiles, list) else parse_tiles(args.tiles)
    walks = args.walk_m if isinstance(args.walk_m, list) else parse_walks(args.walk_m)
    if args.shape is not None:
        k, n = args.shape
        operator = f"gemm.k{k}_n{n}"
    else:
        operator = args.op or "attn.qkv_proj"
        n, k = OPERATORS[operator]
    doc = run_sweep(
        operator=operator,
        n=n,
        k=k,
        tokens=args.tokens,
        configs=tiles,
        walks=walks,
        warmup=args.warmup,
        repeats=args.repeats,
        stages=args.stages,
        family=args.family,
        seed=args.seed,
        extra=not args.no_extra,
        steady=args.steady if isinstance(args.steady, tuple) else parse_steady(args.steady),
        paired=args.paired,
        settle_s=args.settle,
    )
    text = serialize(doc)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"sweep: wrote {len(doc['trials'])} trials to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text + "\n")
    bad = [
        t
        for t in doc["trials"][1:]
        if not (t["relative_rmse"] <= RMSE_LIMIT)  # NaN fails too
    ]
    for t in bad:
        print(
            f"sweep: FAIL {_fmt_config(t)} relative_rmse {t['relative_rmse']} > {RMSE_LIMIT}",
            file=sys.stderr,
        )
    return 1 if bad else 0
