"""`mlx-qsa trace`: run the ten trace profiles (RUNTIME.md §9) and write records in the
exact schema of the reference trace, one JSON line each.

Each tf32 pass runs in a fresh process with `MLX_ENABLE_TF32` set before MLX is imported;
the parent collects the records, writes them and checks the hash invariants of §9.7.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from .profiles import HIDDEN, PROFILES, Profile

# Equality groups of §9.7 (per pass); slots are `p{P}s{S}.{out|raw|pool|f32|K|V}`.
HASH_GROUPS = (
    "p1s0.pool=p1s1.pool",
    "p2s0.raw=p7s0.raw=p9s0.raw",
    "p2s0.pool=p5s0.pool=p7s0.pool=p9s0.pool",
    "p2s0.K=p5s0.K=p9s0.K",
    "p2s0.V=p5s0.V=p7s0.V=p9s0.V",
    "p2s1.out=p5s1.out",
    "p2s1.raw=p7s1.raw=p9s1.raw",
    "p2s1.pool=p5s1.pool=p7s1.pool=p9s1.pool",
    "p2s1.K=p5s1.K=p9s1.K",
    "p2s1.V=p5s1.V=p7s1.V=p9s1.V",
    "p3s0.raw=p4s0.raw",
    "p3s0.pool=p3s1.pool=p4s0.pool=p4s1.pool",
    "p3s0.f32=p3s1.f32=p4s0.f32",
    "p3s0.K=p4s0.K",
    "p3s0.V=p4s0.V",
    "p3s1.K=p4s1.K",
    "p3s1.V=p4s1.V",
    "p3s2.pool=p4s2.pool",
    "p3s2.K=p4s2.K",
    "p3s2.V=p4s2.V",
    "p6s0.pool=p6s1.pool",
    "p7s2.pool=p7s3.pool",
)
_SLOT_STATE = {"raw": 0, "pool": 1, "f32": 2, "K": 3, "V": 4}
# Parameter stream numbers of §9.1.
_PARAMS = (
    ("q_proj.weight", 0), ("k_proj.weight", 1), ("v_proj.weight", 2), ("o_proj.weight", 3),
    ("q_norm.weight", 4), ("k_norm.weight", 5), ("indexer.index_qk_proj.weight", 6),
    ("indexer.q_layernorm.weight", 7), ("indexer.k_layernorm.weight", 8),
    ("q_proj.bias", 9), ("k_proj.bias", 10), ("v_proj.bias", 11), ("o_proj.bias", 12),
)  # fmt: skip


# -- synthetic data (§9.1) -----------------------------------------------------------------


def _rng(seed: int | None, *key: int) -> np.random.Generator:
    return np.random.default_rng(list(key) if seed is None else [seed, *key])


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (nearest even) and return the 16-bit words."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def to_bf16(a: np.ndarray):
    import mlx.core as mx

    return mx.array(bf16_bits(a)).view(mx.bfloat16)


def trace_config(profile: Profile):
    from .config import QSAConfig

    kw: dict[str, Any] = dict(hidden_size=HIDDEN, attention_bias=profile.biased)
    if profile.vision == "no_axes":
        kw["mrope_section"] = None
    if profile.no_indexer:
        kw.update(
            indexer_n_heads=None,
            indexer_kv_heads=None,
            indexer_head_dim=None,
            indexer_budget=None,
            indexer_compress_ratio=None,
        )
    return QSAConfig(**kw)


def trace_weights(cfg, seed: int | None = None) -> dict:
    """HF-named synthetic weights in the stored (plain) norm form."""
    D = cfg.hidden_size
    shapes = {
        "q_proj.weight": (cfg.q_proj_width, D), "k_proj.weight": (cfg.kv_proj_width, D),
        "v_proj.weight": (cfg.kv_proj_width, D),
        "o_proj.weight": (D, cfg.num_attention_heads * cfg.head_dim),
        "q_norm.weight": (cfg.head_dim,), "k_norm.weight": (cfg.head_dim,),
    }  # fmt: skip
    if cfg.has_indexer:
        shapes.update({
            "indexer.index_qk_proj.weight": (cfg.index_proj_width, D),
            "indexer.q_layernorm.weight": (cfg.indexer_head_dim,),
            "indexer.k_layernorm.weight": (cfg.indexer_head_dim,),
        })  # fmt: skip
    if cfg.attention_bias:
        shapes.update({
            "q_proj.bias": (cfg.q_proj_width,), "k_proj.bias": (cfg.kv_proj_width,),
            "v_proj.bias": (cfg.kv_proj_width,), "o_proj.bias": (D,),
        })  # fmt: skip
    out = {}
    for name, k in _PARAMS:
        if name not in shapes:
            continue
        shape = shapes[name]
        z = _rng(seed, 7, k).standard_normal(shape, np.float32)
        if name.endswith(".bias"):
            a = np.float32(0.1) * z
        elif len(shape) == 2:
            a = z / np.float32(np.sqrt(shape[1]))
        else:
            a = np.float32(1) + np.float32(0.1) * z
        out[name] = to_bf16(a)
    return out


def trace_hidden(P: int, S: int, seed: int | None = None):
    return to_bf16(_rng(seed, 11, P, S).standard_normal((1, S, HIDDEN), np.float32))


def vision_state():
    import mlx.core as mx

    from .layer import VisionState

    t = np.arange(4096, dtype=np.int32)
    return VisionState(mx.array(np.stack([t, t // 32, t % 32])), 0)


def digest(a) -> str:
    """sha256 of the full backing's little-endian element bytes (§9.6)."""
    import mlx.core as mx

    if a.dtype in (mx.bfloat16, mx.float16):
        data = np.array(a.view(mx.uint16))
    else:
        data = np.array(a)
    return hashlib.sha256(
        np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes()
    ).hexdigest()


# -- one pass (runs in the worker process) ------------------------------------------------


def run_profile(profile: Profile, tf32: bool, seed: int | None = None) -> list[dict[str, Any]]:
    import mlx.core as mx

    from .config import inv_frequencies
    from .layer import QSAAttention

    cfg = trace_config(profile)
    opts = profile.options(tf32=tf32)
    layer = QSAAttention.from_hf(
        cfg.to_dict(),
        trace_weights(cfg, seed),
        fused=profile.fused_level,
        options=opts,
        zero_centered_norms=False,
    )
    cache = layer.make_cache()
    if profile.prefix:
        layer.prefill_state(trace_hidden(0, profile.prefix, seed), cache)
        mx.eval(cache.state)
    vision = vision_state() if profile.vision != "none" else None
    freqs = inv_frequencies(cfg)
    records, step, pending_trim = [], 0, 0
    for item in profile.steps:
        if item[0] == "trim":
            pending_trim += item[1]
            continue
        _, S, P = item
        if pending_trim:
            cache.trim(pending_trim)
            pending_trim = 0
        if cache.offset != P:
            raise RuntimeError(
                f"trace p{profile.profile}s{step}: cache offset {cache.offset} != step position {P}"
            )
        y = layer(trace_hidden(P, S, seed), cache=cache, vision=vision)
        mx.eval(y, cache.state)
        info = layer.last_call
        states = [a for a in cache.states() if a is not None]
        records.append({
            "kernel": f"qsa_attention_p{profile.profile}_s{step}",
            "sha256": [digest(y)] + [digest(a) for a in states],
            "profile": profile.profile,
            "step": step,
            "rows": S,
            "pos": P,
            "prefix": profile.prefix,
            "fused": profile.fused_level,
            "vision": profile.vision,
            "no_indexer": profile.no_indexer,
            "biased": profile.biased,
            "flash_min": profile.flash_min,
            "prefill_gather": profile.prefill_gather,
            "options": opts.to_trace_dict(),
            "consumers": list(info.consumers),
            "counts": info.counts,
            "offset": cache.offset,
            "pooled_len": cache.pooled_len,
            "state_present": list(cache.state_present),
            "shapes": [list(y.shape)] + [list(a.shape) for a in states],
            "core": layer.core.to_dict(opts.prefill_workspace) if layer.core else None,
            "frequencies": freqs,
        })  # fmt: skip
        step += 1
    return records


def _worker(profiles: list[int], seed: int | None) -> int:
    tf32 = os.environ.get("MLX_ENABLE_TF32", "1") != "0"
    for p in profiles:
        t0 = time.perf_counter()
        for rec in run_profile(PROFILES[p], tf32, seed):
            sys.stdout.write(json.dumps(rec, separators=(",", ":")) + "\n")
        sys.stdout.flush()
        print(
            f"  tf32={'on' if tf32 else 'off'} p{p}: {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    return 0


def run_pass(tf32: bool, profiles: list[int], seed: int | None = None) -> list[dict[str, Any]]:
    """One pass in a fresh process with MLX_ENABLE_TF32 set before MLX loads."""
    env = dict(os.environ, MLX_ENABLE_TF32="1" if tf32 else "0")
    cmd = [
        sys.executable,
        "-m",
        "mlx_qsa.trace",
        "--worker",
        "--profiles",
        ",".join(map(str, profiles)),
    ]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"trace pass tf32={tf32} failed with exit code {proc.returncode}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def serialize(records: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(r, separators=(",", ":")) for r in records)


# -- hash invariants (§9.7) ------------------------------------------------------------------


def slot_digest(records_by_kernel: dict[str, dict], slot: str) -> str | None:
    rec_id, part = slot.split(".")
    p, s = rec_id[1:].split("s")
    rec = records_by_kernel.get(f"qsa_attention_p{p}_s{s}")
    if rec is None:
        return None
    if part == "out":
        return rec["sha256"][0]
    idx = _SLOT_STATE[part]
    if not rec["state_present"][idx]:
        return None
    return rec["sha256"][1 + sum(rec["state_present"][:idx])]


def check_hash_groups(records: list[dict[str, Any]]) -> list[str]:
    """Failed groups of §9.7 in each pass (groups whose records are absent are skipped),
    plus tf32 independence between the passes."""
    failures = []
    passes: dict[bool, dict[str, dict]] = {}
    for r in records:
        passes.setdefault(r["options"]["tf32"], {})[r["kernel"]] = r
    for tf32, by_kernel in passes.items():
        for group in HASH_GROUPS:
            digests = [slot_digest(by_kernel, s) for s in group.split("=")]
            if any(d is None for d in digests):
                continue
            if len(set(digests)) != 1:
                failures.append(f"tf32={tf32}: {group}")
    if len(passes) == 2:
        for kernel, r in passes[True].items():
            twin = passes[False].get(kernel)
            if twin is not None and twin["sha256"] != r["sha256"]:
                failures.append(f"tf32 independence: {kernel}")
    return failures


# -- CLI ------------------------------------------------------------------------------------


def _profile_list(text: str) -> list[int]:
    if text in ("all", ""):
        return list(range(len(PROFILES)))
    try:
        out = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--profiles: expected 'all' or ints like 0,2,5, got {text!r}"
        ) from None
    bad = [p for p in out if not 0 <= p < len(PROFILES)]
    if bad:
        raise argparse.ArgumentTypeError(
            f"--profiles: profiles are 0..{len(PROFILES) - 1}, got {bad}"
        )
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="qsa_trace.jsonl", help="output JSONL file ('-': stdout)")
    p.add_argument(
        "--profiles",
        type=_profile_list,
        default="all",
        help="comma-separated profile numbers or 'all' (default)",
    )
    p.add_argument(
        "--tf32",
        choices=("both", "on", "off"),
        default="both",
        help="MLX_ENABLE_TF32 passes: both (default; on then off), on, off",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="prepend N to every random stream (default: the spec's streams)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    profiles = args.profiles if isinstance(args.profiles, list) else _profile_list(args.profiles)
    if args.worker:
        return _worker(profiles, args.seed)
    t0 = time.perf_counter()
    passes = {"both": (True, False), "on": (True,), "off": (False,)}[args.tf32]
    records: list[dict[str, Any]] = []
    for tf32 in passes:
        print(
            f"mlx-qsa trace: pass tf32={'on' if tf32 else 'off'}, profiles {profiles}",
            file=sys.stderr,
            flush=True,
        )
        records += run_pass(tf32, profiles, args.seed)
    text = serialize(records)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
    failures = check_hash_groups(records)
    n_groups = sum(1 for _ in HASH_GROUPS) * len(passes)
    status = "all hash invariants hold" if not failures else f"FAILED: {failures}"
    print(
        f"mlx-qsa trace: {len(records)} records ({len(passes)} pass(es) x "
        f"{len(records) // max(1, len(passes))}) in {time.perf_counter() - t0:.1f} s -> "
        f"{args.out}; {n_groups} group checks: {status}",
        file=sys.stderr,
    )
    return 0 if not failures else 1


if __name__ == "__main__":
    from .cli import main

    sys.exit(main(["trace", *sys.argv[1:]]))
