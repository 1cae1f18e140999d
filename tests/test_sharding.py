"""Tensor-parallel QSA (`QSAAttention.shard`, src/mlx_qsa/sharding.py).

Single-process tests: the head layout, the segment-wise weight split of every fusion level,
the errors, and an N-rank forward simulated in one process (the `all_sum` of `o_proj`
replaced by a host-side sum). The distributed tests start 2 and 4 ranks on localhost with
MLX's ring backend (`mlx.launch`) running tests/sharding_worker.py, and compare the ranks'
selections and outputs bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import sharding_worker as worker
from conftest import hidden_rows, small_config, synthetic_weights

from mlx_qsa import QSAAttention, QSACache, QSAConfig, QSAOptions
from mlx_qsa.sharding import ShardLayout, plan_layout, segment_rows

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"


class FakeGroup:
    """Rank `rank` of a `size`-way group for the weight split (no collective is called)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def make_layer(cfg: QSAConfig, fused: int, dtype=mx.float32, **opts) -> QSAAttention:
    w = synthetic_weights(cfg, dtype)
    return QSAAttention.from_hf(
        cfg.to_dict(), w, fused=fused, options=QSAOptions(**opts), zero_centered_norms=False
    )


def full_weights(layer: QSAAttention) -> dict[str, np.ndarray]:
    from mlx.utils import tree_flatten

    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(layer.parameters())}


# -- layout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 4, 6, 8, 12, 24])
def test_layout_real_geometry(size):
    """H = 24, H_kv = 2: every divisor of 24 gives contiguous heads and the KV heads read."""
    cfg = QSAConfig()
    G = cfg.gqa_group
    seen = []
    for r in range(size):
        lay = plan_layout(cfg, size, r)
        assert lay.heads == tuple(range(r * 24 // size, (r + 1) * 24 // size))
        seen += lay.heads
        run = len(lay.heads) // len(lay.kv_heads)
        assert run * len(lay.kv_heads) == len(lay.heads)
        for i, h in enumerate(lay.heads):
            assert lay.kv_heads[i // run] == h // G  # local head i reads the right KV head
        assert lay.split_kv == (2 % size == 0)
        if size in (4, 6, 8, 12, 24):  # each rank's heads read one KV head: it keeps one
            assert lay.kv_heads == (lay.heads[0] // G,)
    assert seen == list(range(24))
    if size == 3:  # rank 1 holds heads 8..15, which read KV heads 0 and 1
        assert plan_layout(cfg, 3, 1).kv_heads == (0, 1)


def test_layout_uneven_straddle():
    """H = 24, H_kv = 4 over 3 ranks: heads 0..7 read KV 0 (six) and 1 (two) — runs of 2."""
    cfg = QSAConfig(num_key_value_heads=4)
    assert plan_layout(cfg, 3, 0).kv_heads == (0, 0, 0, 1)
    assert plan_layout(cfg, 3, 1).kv_heads == (1, 2)  # heads 8..11 and 12..15
    assert plan_layout(cfg, 3, 2).kv_heads == (2, 3, 3, 3)
    assert plan_layout(cfg, 2, 1) == ShardLayout(2, 1, tuple(range(12, 24)), (2, 3), True)


# -- weight split ------------------------------------------------------------------------------


def _blocks(w: np.ndarray, bounds: list[int], size: int, rank: int) -> np.ndarray:
    """Segment-wise split by hand: each segment's rank-th N-th, concatenated."""
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        n = (b - a) // size
        parts.append(w[a + rank * n : a + (rank + 1) * n])
    return np.concatenate(parts)


@pytest.mark.parametrize("fused", [0, 3, 4])
@pytest.mark.parametrize("size", [2, 4])
def test_weight_split_segment_wise(fused, size):
    cfg = small_config(num_attention_heads=8, num_key_value_heads=4)
    base = make_layer(cfg, fused)
    full = full_weights(base)
    qw, kvw, iw = cfg.q_proj_width, cfg.kv_proj_width, cfg.index_proj_width
    for r in range(size):
        layer = make_layer(cfg, fused)
        layer.shard(FakeGroup(size, r))
        got = full_weights(layer)
        if fused == 0:
            for name in ("q_proj", "k_proj", "v_proj"):
                w = full[f"{name}.weight"]
                n = w.shape[0] // size
                np.testing.assert_array_equal(got[f"{name}.weight"], w[r * n : (r + 1) * n])
            np.testing.assert_array_equal(
                got["indexer.index_qk_proj.weight"], full["indexer.index_qk_proj.weight"]
            )
        else:
            name = "qkv_proj" if fused == 3 else "qkvi_proj"
            w = full[f"{name}.weight"]
            want = _blocks(w, [0, qw, qw + kvw, qw + 2 * kvw], size, r)
            if fused == 4:  # the indexer rows stay whole on every rank
                want = np.concatenate([want, w[qw + 2 * kvw :]])
                assert w.shape[0] == qw + 2 * kvw + iw
            np.testing.assert_array_equal(got[f"{name}.weight"], want)
            naive = w[r * (w.shape[0] // size) : (r + 1) * (w.shape[0] // size)]
            assert naive.shape != want.shape or not np.array_equal(naive, want)
        # o_proj: the rank's heads' input columns; norms whole.
        wo = full["o_proj.weight"]
        c = wo.shape[1] // size
        np.testing.assert_array_equal(got["o_proj.weight"], wo[:, r * c : (r + 1) * c])
        for k in ("q_norm.weight", "k_norm.weight", "indexer.q_layernorm.weight"):
            np.testing.assert_array_equal(got[k], full[k])
        # the per-rank config drives the forward
        assert layer.config.num_attention_heads == 8 // size
        assert layer.config.num_key_value_heads == len(layer.shard_layout.kv_heads)
        assert layer.full_config == cfg


def test_weight_split_kept_kv_heads_and_bias():
    """N = 4 over H_kv = 2 (kept, not split) with biases: rows and biases of the KV head read."""
    cfg = small_config(attention_bias=True)  # 4 heads, 2 KV heads, fused forced to 0
    full = full_weights(make_layer(cfg, 0))
    d = cfg.head_dim
    for r in range(4):
        layer = make_layer(cfg, 0)
        layer.shard(FakeGroup(4, r))
        got = full_weights(layer)
        kv = r // 2
        assert layer.shard_layout.kv_heads == (kv,)
        for name in ("k_proj", "v_proj"):
            for p in ("weight", "bias"):
                np.testing.assert_array_equal(
                    got[f"{name}.{p}"], full[f"{name}.{p}"][kv * d : (kv + 1) * d]
                )
        q = slice(r * 2 * d, (r + 1) * 2 * d)
        np.testing.assert_array_equal(got["q_proj.bias"], full["q_proj.bias"][q])
        np.testing.assert_array_equal(got["o_proj.bias"], full["o_proj.bias"])  # added once


@pytest.mark.parametrize("fused", [0, 3, 4])
def test_segment_rows_match_fused_layout(fused):
    """`segment_rows` of a fused level is the level-0 rows mapped into the fused matrix."""
    cfg = small_config(num_attention_heads=8, num_key_value_heads=4)
    lay = plan_layout(cfg, 2, 1)
    rows0 = segment_rows(cfg, lay, 0)
    rows = segment_rows(cfg, lay, fused)
    if fused == 0:
        assert set(rows) == {"q_proj", "k_proj", "v_proj"}
        return
    (got,) = rows.values()
    qw, kvw = cfg.q_proj_width, cfg.kv_proj_width
    want = [rows0["q_proj"], qw + rows0["k_proj"], qw + kvw + rows0["v_proj"]]
    if fused == 4:
        want.append(mx.arange(qw + 2 * kvw, qw + 2 * kvw + cfg.index_proj_width))
    assert mx.array_equal(got, mx.concatenate(want)).item()


# -- simulated N-rank forward in one process ---------------------------------------------------


SIM_CASES = [
    # (config changes, fused, size): KV split, KV kept, straddling ranks, bias, every level
    (dict(num_attention_heads=8, num_key_value_heads=4), 0, 2),
    (dict(num_attention_heads=8, num_key_value_heads=4), 3, 4),
    (dict(num_attention_heads=8, num_key_value_heads=4), 4, 8),
    (dict(num_attention_heads=12, num_key_value_heads=2), 4, 3),
    (dict(num_attention_heads=24, num_key_value_heads=4), 0, 3),
    (dict(num_attention_heads=24, num_key_value_heads=4), 3, 3),
    (dict(attention_bias=True), 0, 4),
]


@pytest.mark.parametrize("changes,fused,size", SIM_CASES)
def test_simulated_ranks_equal_unsharded(monkeypatch, changes, fused, size):
    cfg = small_config(**changes)
    ref = make_layer(cfg, fused)
    x = hidden_rows(sum(worker.SCHEDULE) + 2, cfg.hidden_size, mx.float32)
    want = worker.run_schedule(ref, x)
    # o_proj's all_sum becomes the identity: each rank returns its partial sum (+ bias).
    monkeypatch.setattr(mx.distributed, "all_sum", lambda a, group=None, stream=None: a)
    runs = []
    for r in range(size):
        layer = make_layer(cfg, fused)
        layer.shard(FakeGroup(size, r))
        runs.append(worker.run_schedule(layer, x))
        assert runs[-1]["cache"].keys.shape[1] == len(layer.shard_layout.kv_heads)
        kv = mx.array(layer.shard_layout.kv_heads)
        T = want["cache"].offset
        k_ref = mx.take(want["cache"].keys[:, :, :T], kv, axis=1)
        assert mx.array_equal(runs[-1]["cache"].keys[:, :, :T], k_ref).item()
        expect = worker.expected_nbytes(
            want["cache"], len(layer.shard_layout.kv_heads), cfg.num_key_value_heads
        )
        assert runs[-1]["nbytes"] == expect
    bias = ref.o_proj.bias if cfg.attention_bias else 0
    for i, y_ref in enumerate(want["outs"]):
        y = sum(run["outs"][i] for run in runs) - (size - 1) * bias
        assert worker.rel_err(y, y_ref) <= 1e-5, i
    for run in runs:
        assert run["kinds"] == want["kinds"]
        for a, e in zip(run["sels"], want["sels"], strict=True):
            sa, se = worker.selection_arrays(a), worker.selection_arrays(e)
            assert sa.keys() == se.keys()
            for k in sa:
                np.testing.assert_array_equal(sa[k], se[k])
    assert "blocks" in want["kinds"]


# -- errors ------------------------------------------------------------------------------------


def test_group_size_not_dividing_heads_leaves_layer_untouched():
    layer = make_layer(small_config(), 4)  # 4 heads
    before = full_weights(layer)
    cfg = layer.config
    with pytest.raises(ValueError, match="group of size 3 does not divide num_attention_heads=4"):
        layer.shard(FakeGroup(3, 0))
    assert layer.shard_layout is None and layer.config is cfg
    after = full_weights(layer)
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="mx.distributed.Group"):
        layer.shard("two")


def test_shard_twice_is_refused():
    layer = make_layer(small_config(), 0)
    layer.shard(FakeGroup(2, 0))
    with pytest.raises(ValueError, match="already sharded over a group of size 2"):
        layer.shard(FakeGroup(2, 0))


def _cache_snapshot(cache):
    return (cache.offset, cache.pooled_len, [np.array(a) for a in cache.state])


def _same(a, b) -> bool:
    return a[:2] == b[:2] and all(np.array_equal(x, y) for x, y in zip(a[2], b[2], strict=True))


def test_cache_made_before_shard_is_refused_untouched():
    cfg = small_config()
    layer = make_layer(cfg, 3)
    x = hidden_rows(24, cfg.hidden_size, mx.float32)
    cache = layer.make_cache()
    layer(x[:, :20], cache=cache)
    snap = _cache_snapshot(cache)
    layer.shard(FakeGroup(2, 0))
    with pytest.raises(ValueError, match=r"made before shard\(\)"):
        layer(x[:, 20:21], cache=cache)
    with pytest.raises(ValueError, match=r"made before shard\(\)"):
        layer.prefill_state(x[:, 20:22], cache)
    assert _same(snap, _cache_snapshot(cache))


def test_cache_of_another_group_or_rank_is_refused_untouched():
    cfg = small_config()
    x = hidden_rows(24, cfg.hidden_size, mx.float32)
    rank0, rank1, four = (make_layer(cfg, 0) for _ in range(3))
    rank0.shard(FakeGroup(2, 0))
    rank1.shard(FakeGroup(2, 1))
    four.shard(FakeGroup(4, 0))
    plain = make_layer(cfg, 0)
    for owner, caller, msg in (
        (rank1, rank0, "made for rank 1 of a group of size 2, this layer is rank 0"),
        (four, rank0, "made for rank 0 of a group of size 4, this layer is rank 0 of a group of"),
        (rank0, plain, "sharded over a group of size 2 .rank 0., this layer is not sharded"),
    ):
        cache = owner.make_cache()
        snap = _cache_snapshot(cache)
        with pytest.raises(ValueError, match=msg):
            caller(x[:, :3], cache=cache)
        assert _same(snap, _cache_snapshot(cache))


def _filled(layer: QSAAttention, x: mx.array, n: int = 9):
    cache = layer.make_cache()
    layer(x[:, :n], cache=cache)
    mx.eval(cache.state)
    return cache


def _layer_snapshot(layer: QSAAttention):
    return dict(layer.counters), layer.last_call


def test_restored_cache_of_another_shard_is_refused_untouched(monkeypatch):
    """A restored cache carries its shard identity in meta_state: another rank's, another
    group's, an unsharded layer's or a sharded one's is refused before anything moves, also
    where the K/V arrays have the very shape this layer expects (same head count per rank,
    a group of 1)."""
    monkeypatch.setattr(mx.distributed, "all_sum", lambda a, group=None, stream=None: a)
    cfg = small_config(num_attention_heads=8, num_key_value_heads=4)  # 2 KV heads per rank
    x = hidden_rows(12, cfg.hidden_size, mx.float32)
    layers = {}
    for name, group in (("plain", None), ("r0", (2, 0)), ("r1", (2, 1)), ("g4", (4, 0)),
                        ("one", (1, 0))):  # fmt: skip
        layers[name] = make_layer(cfg, 0)
        if group is not None:
            layers[name].shard(FakeGroup(*group))
    saved = {n: _filled(layer, x) for n, layer in layers.items()}
    cases = [
        ("plain", "r0", "restored from the state of an unsharded layer .all K/V heads., this "
         "layer is rank 0 of a group of size 2 .K/V heads \\[0, 1\\]."),
        ("plain", "one", "restored from the state of an unsharded layer"),  # same shape
        ("r1", "r0", "restored from the state of rank 1 of a group of size 2, this layer is "
         "rank 0 of a group of size 2: each rank keeps its own cache .K/V heads \\[2, 3\\] "
         "there, \\[0, 1\\] here."),  # same shape [1, 2, cap, d]
        ("g4", "r0", "restored from the state of rank 0 of a group of size 4"),
        ("r0", "plain", "restored from the state of a layer sharded over a group of size 2 "
         ".rank 0., this layer is not sharded"),
        ("one", "plain", "restored from the state of a layer sharded over a group of size 1"),
    ]  # fmt: skip
    assert saved["r1"].keys.shape == saved["r0"].keys.shape
    assert saved["plain"].keys.shape == saved["one"].keys.shape
    for owner, caller, msg in cases:
        src = saved[owner]
        restored = QSACache.from_state(src.state, src.meta_state)
        layer = layers[caller]
        snap, before = _cache_snapshot(restored), _layer_snapshot(layer)
        with pytest.raises(ValueError, match=f"^cache: {msg}"):
            layer(x[:, 9:10], cache=restored)
        with pytest.raises(ValueError, match=f"^cache: {msg}"):
            layer.prefill_state(x[:, 9:11], restored)
        assert _same(snap, _cache_snapshot(restored))
        assert _layer_snapshot(layer) == before
    # Each rank's own restored state is accepted and continues like the original cache.
    for name in ("r0", "r1", "one", "plain"):
        c = saved[name]
        restored = QSACache.from_state(c.state, c.meta_state)
        y_restored = layers[name](x[:, 9:12], cache=restored)
        y = layers[name](x[:, 9:12], cache=c)
        assert mx.array_equal(y, y_restored).item()
        assert _same(_cache_snapshot(c), _cache_snapshot(restored))


def test_meta_state_carries_the_shard_identity(monkeypatch):
    """Sharded caches add a 7th meta_state string; unsharded ones keep the 6-string form."""
    monkeypatch.setattr(mx.distributed, "all_sum", lambda a, group=None, stream=None: a)
    cfg = small_config(num_attention_heads=24, num_key_value_heads=4)
    x = hidden_rows(9, cfg.hidden_size, mx.float32)
    plain = make_layer(cfg, 3)
    straddle = make_layer(cfg, 3)
    straddle.shard(FakeGroup(3, 0))  # heads 0..7 read KV 0 (six) and 1 (two): kept (0, 0, 0, 1)
    a, b = _filled(plain, x), _filled(straddle, x)
    assert len(a.meta_state) == 6
    assert b.meta_state == (*a.meta_state, "3:0:0,0,0,1")
    restored = QSACache.from_state(b.state, b.meta_state)
    assert restored.shard_key == (3, 0, (0, 0, 0, 1)) and restored.meta_state == b.meta_state
    legacy = QSACache.from_state(a.state, a.meta_state)  # 6 strings: an unsharded layer's
    assert legacy.shard_key is None and legacy.shard_known
    for bad in ("3:3:0", "3:0:", "x:0:0", "3:0:0:1", "3:-1:0"):
        with pytest.raises(ValueError, match="^meta_state: shard identity must be"):
            QSACache.from_state(b.state, (*b.meta_state[:6], bad))
    with pytest.raises(ValueError, match="^meta_state: shard identity '3:0:0' names 1 K/V"):
        QSACache.from_state(b.state, (*b.meta_state[:6], "3:0:0"))  # arrays hold 4 heads
    with pytest.raises(ValueError, match="^meta_state: expected 5, 6 or 7 strings, got 8"):
        QSACache.from_state(b.state, (*b.meta_state, "x"))


def test_state_assigned_without_meta_state_is_refused_by_a_sharded_layer(monkeypatch):
    """`cache.state = ...` alone says nothing of whose heads the arrays are: a sharded layer
    refuses it (even into a cache it made) until a meta_state says whose they are."""
    monkeypatch.setattr(mx.distributed, "all_sum", lambda a, group=None, stream=None: a)
    cfg = small_config(num_attention_heads=8, num_key_value_heads=4)
    x = hidden_rows(12, cfg.hidden_size, mx.float32)
    r0, r1 = make_layer(cfg, 4), make_layer(cfg, 4)
    r0.shard(FakeGroup(2, 0))
    r1.shard(FakeGroup(2, 1))
    own, other = _filled(r0, x), _filled(r1, x)
    cache = r0.make_cache()
    cache.state = other.state  # same shapes as rank 0's own arrays
    snap = _cache_snapshot(cache)
    with pytest.raises(ValueError, match="^cache: holds K/V state whose shard is unknown"):
        r0(x[:, 9:10], cache=cache)
    assert _same(snap, _cache_snapshot(cache))
    cache.meta_state = other.meta_state
    with pytest.raises(ValueError, match="^cache: restored from the state of rank 1 of a group"):
        r0(x[:, 9:10], cache=cache)
    cache.state = own.state
    cache.meta_state = own.meta_state
    y = r0(x[:, 9:12], cache=cache)
    assert mx.array_equal(y, r0(x[:, 9:12], cache=own)).item()
    # An unsharded layer keeps accepting state-only assignment (the pre-sharding protocol).
    plain = make_layer(cfg, 4)
    c = plain.make_cache()
    c.state = _filled(plain, x).state
    c.offset = 9
    plain(x[:, 9:10], cache=c)


def test_bare_cache_is_claimed_by_its_first_sharded_call(monkeypatch):
    """A QSACache() built directly takes the shard identity of the layer that first writes it,
    so its saved meta_state restores onto that rank only."""
    monkeypatch.setattr(mx.distributed, "all_sum", lambda a, group=None, stream=None: a)
    cfg = small_config()
    x = hidden_rows(8, cfg.hidden_size, mx.float32)
    layer = make_layer(cfg, 0)
    layer.shard(FakeGroup(2, 1))
    cache = QSACache(index_head_dim=cfg.indexer_head_dim)
    layer(x[:, :5], cache=cache)
    assert cache.shard_key == layer.shard_layout.key == (2, 1, (1,))
    assert cache.meta_state[6] == "2:1:1"
    other = make_layer(cfg, 0)
    other.shard(FakeGroup(2, 0))
    with pytest.raises(ValueError, match="^cache: restored from the state of rank 1"):
        other(x[:, 5:6], cache=QSACache.from_state(cache.state, cache.meta_state))


def test_make_cache_after_shard_protocol():
    """The per-rank cache: same state / meta_state / trim protocol, smaller K/V."""
    cfg = small_config()
    layer = make_layer(cfg, 4)
    layer.shard(FakeGroup(2, 1))
    cache = layer.make_cache()
    assert cache.signature[-1] == (2, 1, (1,))
    assert cache.empty() and cache.nbytes == 0 and cache.is_trimmable()


# -- distributed: the ring backend on localhost ------------------------------------------------


def _free_base_port(n: int) -> int:
    """A base port with n consecutive free ports (the ring backend listens on base + rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port range for the ring backend")


def _launch_command(n: int, port: int, out: Path) -> list[str]:
    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    script = [sys.executable, str(TESTS / "sharding_worker.py"), str(out)]
    return [launcher, "--backend", "ring", "-n", str(n), "-p", str(port), "--", *script]


def _have_ring() -> bool:
    launcher = shutil.which("mlx.launch") or Path(sys.executable).parent / "mlx.launch"
    return mx.distributed.is_available() and Path(launcher).exists()


@pytest.mark.skipif(not _have_ring(), reason="mlx.launch / the ring backend is not available")
@pytest.mark.parametrize("n", [2, 4])
def test_ring_ranks_equal_unsharded_and_each_other(n, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    cmd = _launch_command(n, _free_base_port(n), tmp_path)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
        log, _ = proc.communicate()
        pytest.fail(f"{n} ranks timed out:\n{log.decode(errors='replace')[-4000:]}")
    text = log.decode(errors="replace")
    reports = {}
    for r in range(n):
        f = tmp_path / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no report (rc {proc.returncode}):\n{text[-4000:]}"
        reports[r] = json.loads(f.read_text())
    errors = [c["error"] for rep in reports.values() for c in rep if "error" in c]
    assert not errors, errors[0]
    assert proc.returncode == 0, text[-4000:]
    for case in worker.CASES:
        per_rank = [dict(np.load(tmp_path / f"{case}.rank{r}.npz")) for r in range(n)]
        for r in range(1, n):  # selections and outputs: the same bits on every rank
            assert per_rank[r].keys() == per_rank[0].keys()
            for k, v in per_rank[0].items():
                np.testing.assert_array_equal(per_rank[r][k], v, err_msg=f"{case} rank {r} {k}")
        for r, rep in reports.items():
            c = next(c for c in rep if c["case"] == case)
            assert c["size"] == n and c["heads"] == list(range(r * 4 // n, (r + 1) * 4 // n))
            assert "blocks" in c["kinds"] and c["nbytes"] < c["nbytes_unsharded"]
