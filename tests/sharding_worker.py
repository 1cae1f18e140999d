"""One rank of the tensor-parallel test (tests/test_sharding.py starts it through mlx.launch).

Every rank builds the same unsharded layer and a sharded copy, runs the same schedule on both
(uneven prefill chunks, decodes, a 4-row verify, a trim, a decode on a cache restored from
state / meta_state), checks its output against the unsharded layer's, its K/V shard and its
cache size, and writes its selections and outputs to `<out>/<case>.rank<r>.npz` so the test
can compare the ranks bit for bit. Also imported by the single-process tests (`run_schedule`).

    mlx.launch --backend ring -n 2 -- python tests/sharding_worker.py OUT_DIR [CASE ...]
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import hidden_rows, small_config, synthetic_weights  # noqa: E402

from mlx_qsa import QSAAttention, QSACache, QSAOptions  # noqa: E402

# Prefill chunks (uneven), decodes, a 4-row verify, then trim 3 and decode again.
SCHEDULE = (13, 29, 7, 1, 1, 1, 4)
TRIM = 3
TOL = {"float32": 1e-5, "bfloat16": 1e-2}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}

# name -> (fused, dtype, options, config changes)
CASES = {
    "f0_f32": (0, "float32", {}, {}),
    "f3_f32_gather": (3, "float32", {"gather_min_context": 0}, {}),
    "f4_f32": (4, "float32", {}, {}),
    "f4_f32_eager": (4, "float32", {"compiled": False}, {}),
    "f0_bf16_bias": (0, "bfloat16", {}, {"attention_bias": True}),
    "f3_bf16": (3, "bfloat16", {}, {}),
    "f4_bf16_gather": (4, "bfloat16", {"gather_min_context": 0}, {}),
}


def build(case: str) -> tuple[QSAAttention, mx.array]:
    """The unsharded layer of a case and its input rows (same bits on every rank)."""
    fused, dtype, opts, changes = CASES[case]
    cfg = small_config(**changes)
    w = synthetic_weights(cfg, DTYPES[dtype])
    layer = QSAAttention.from_hf(
        cfg.to_dict(), w, fused=fused, options=QSAOptions(**opts), zero_centered_norms=False
    )
    n = sum(SCHEDULE) + 2
    return layer, hidden_rows(n, cfg.hidden_size, DTYPES[dtype])


def record_selections(layer: QSAAttention) -> list:
    """Wrap the layer's indexer entry points; the list collects every Selection returned."""
    seen: list = []
    for name in ("_compiled_indexer", "_eager_indexer"):
        fn = getattr(layer, name)

        def wrapped(*a, _fn=fn, **k):
            sel = _fn(*a, **k)
            seen.append(sel)
            return sel

        object.__setattr__(layer, name, wrapped)
    return seen


def selection_arrays(sel) -> dict[str, np.ndarray]:
    out = {"kind": np.array(sel.kind)}
    for f in ("ids", "valid", "scores", "slots", "slot_valid", "mask"):
        a = getattr(sel, f)
        if a is not None:
            out[f] = np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)
    return out


def run_schedule(layer: QSAAttention, x: mx.array) -> dict:
    """Outputs, selections and caches of the schedule (the last call uses a restored cache)."""
    sels = record_selections(layer)
    cache = layer.make_cache()
    outs, o = [], 0
    for n in SCHEDULE:
        outs.append(layer(x[:, o : o + n], cache=cache))
        o += n
    cache.trim(TRIM)
    o -= TRIM
    outs.append(layer(x[:, o : o + 1], cache=cache))
    o += 1
    mx.eval(outs, cache.state)
    nbytes = cache.nbytes
    restored = QSACache.from_state(cache.state, cache.meta_state)
    outs.append(layer(x[:, o : o + 1], cache=restored))
    mx.eval(outs, restored.state)
    kinds = [s.kind for s in sels]
    return {"outs": outs, "sels": sels, "kinds": kinds, "cache": cache, "nbytes": nbytes}


def rel_err(a: mx.array, e: mx.array) -> float:
    a64 = np.array(a.astype(mx.float32), np.float64)
    e64 = np.array(e.astype(mx.float32), np.float64)
    return float(np.linalg.norm(a64 - e64) / np.linalg.norm(e64))


def expected_nbytes(ref: QSACache, kept: int, total: int) -> int:
    kv = ref.keys.nbytes + ref.values.nbytes
    return ref.nbytes - kv + kv * kept // total


def check_case(case: str, group: mx.distributed.Group, out_dir: Path) -> dict:
    """Run one case on this rank; raises AssertionError on any mismatch."""
    ref_layer, x = build(case)
    tp_layer, _ = build(case)
    tp_layer.shard(group)
    lay = tp_layer.shard_layout
    ref = run_schedule(ref_layer, x)
    got = run_schedule(tp_layer, x)
    dtype = CASES[case][1]

    errs = [rel_err(a, e) for a, e in zip(got["outs"], ref["outs"], strict=True)]
    assert max(errs) <= TOL[dtype], f"{case}: rel err {max(errs):.3g} > {TOL[dtype]}"
    assert got["kinds"] == ref["kinds"], f"{case}: selection kinds {got['kinds']}"
    assert "blocks" in got["kinds"], f"{case}: the schedule never reached the sparse regime"
    for i, (a, e) in enumerate(zip(got["sels"], ref["sels"], strict=True)):
        sa, se = selection_arrays(a), selection_arrays(e)
        assert sa.keys() == se.keys(), f"{case}: selection {i} fields differ"
        for k in sa:
            assert np.array_equal(sa[k], se[k]), f"{case}: selection {i}.{k} != unsharded"

    # The rank's cache: its own K/V heads (same bits as the unsharded cache's), all else whole.
    c, rc = got["cache"], ref["cache"]
    kv = mx.array(lay.kv_heads)
    T = c.offset
    assert c.keys.shape[1] == len(lay.kv_heads)
    for name in ("keys", "values"):
        mine = getattr(c, name)[:, :, :T]
        theirs = mx.take(getattr(rc, name)[:, :, :T], kv, axis=1)
        assert mx.array_equal(mine, theirs).item(), f"{case}: {name} shard != unsharded heads"
    for name in ("raw_keys", "pooled"):
        assert mx.array_equal(getattr(c, name), getattr(rc, name)).item(), f"{case}: {name}"
    H_kv = ref_layer.config.num_key_value_heads
    want = expected_nbytes(rc, len(lay.kv_heads), H_kv)
    assert got["nbytes"] == want, f"{case}: nbytes {got['nbytes']} != {want}"
    # The rank's meta_state: the unsharded one's six strings plus its shard identity.
    identity = f"{lay.size}:{lay.rank}:{','.join(str(h) for h in lay.kv_heads)}"
    assert c.meta_state == (*rc.meta_state, identity), f"{case}: meta_state {c.meta_state}"

    arrays = {f"out{i}": np.array(o.astype(mx.float32)) for i, o in enumerate(got["outs"])}
    for i, s in enumerate(got["sels"]):
        arrays.update({f"sel{i}_{k}": v for k, v in selection_arrays(s).items()})
    np.savez(out_dir / f"{case}.rank{group.rank()}.npz", **arrays)
    return {
        "case": case,
        "rank": group.rank(),
        "size": group.size(),
        "kv_heads": list(lay.kv_heads),
        "heads": list(lay.heads),
        "max_rel_err": max(errs),
        "kinds": got["kinds"],
        "nbytes": got["nbytes"],
        "nbytes_unsharded": ref["nbytes"],
    }


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = argv[1:] or list(CASES)
    group = mx.distributed.init(strict=True, backend="ring")
    results, ok = [], True
    for case in cases:
        try:
            results.append(check_case(case, group, out_dir))
        except Exception:  # report every case, then fail
            ok = False
            results.append({"case": case, "rank": group.rank(), "error": traceback.format_exc()})
    (out_dir / f"rank{group.rank()}.json").write_text(json.dumps(results, indent=1))
    for c in results:
        if "error" in c:
            print(f"rank {group.rank()}: {c['case']} FAILED\n{c['error']}", flush=True)
        elif group.rank() == 0:
            print(
                f"{c['case']}: {c['size']} ranks, max rel err {c['max_rel_err']:.2e}, "
                f"selections equal to unsharded, cache {c['nbytes']} of "
                f"{c['nbytes_unsharded']} bytes per rank",
                flush=True,
            )
    # A final collective: every rank reaches it only after all its cases ran.
    mx.eval(mx.distributed.all_sum(mx.array([0 if ok else 1]), group=group))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
