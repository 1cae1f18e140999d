"""What the CUDA kernels need from a GPU (`kernels/device.py`) and how each launcher's rule and
the implementation choice follow it. Pure rules with explicit limits: they run on any machine."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_qsa.kernels import device, impl_for
from mlx_qsa.kernels._launch import attention_unsupported
from mlx_qsa.kernels.device import HOPPER, DeviceLimits
from mlx_qsa.kernels.gemm import family_for_device, plan_gemm
from mlx_qsa.kernels.prefill_flash import prefill_flash_unsupported, smem_bytes
from mlx_qsa.kernels.prefill_score import SMEM_BYTES, prefill_score_supports
from mlx_qsa.kernels.selector import selector_unsupported, topk_shape, topk_smem_bytes

A100 = DeviceLimits((8, 0), 166_912)
L40S = DeviceLimits((8, 9), 101_376)
T4 = DeviceLimits((7, 5), 65_536)
B200 = DeviceLimits((10, 0), 232_448)


def test_kernel_floor_and_hopper_rules():
    assert device.kernels_unsupported(A100) is None and device.kernels_unsupported(B200) is None
    assert "sm_80 or newer" in device.kernels_unsupported(
        T4
    ) and "sm_75" in device.kernels_unsupported(T4)
    assert device.hopper_unsupported(HOPPER) is None
    for other in (A100, L40S, B200):  # wgmma is sm_90a only (Blackwell has tcgen05 instead)
        assert f"this GPU is {other.arch}" in device.hopper_unsupported(other)
    assert device.shared_memory_unsupported(L40S, 101_376, "x") is None
    why = device.shared_memory_unsupported(L40S, 101_377, "the thing")
    assert why == "the thing needs 101377 bytes of shared memory per block; sm_89 allows 101376"


def test_implementation_choice():
    assert impl_for("auto", None) == "portable"  # not a CUDA GPU
    assert impl_for("auto", T4) == "portable"  # below the kernels' floor
    assert impl_for("auto", A100) == "cuda"
    assert impl_for("auto", HOPPER) == "cuda"
    assert impl_for("portable", HOPPER) == "portable"


def test_prefill_flash_follows_shared_memory():
    # The real geometry: d 256, 512 blocks of 4 tokens per row: 214 KiB of shared memory.
    args = (mx.bfloat16, 24, 2, 256, 4, 512)
    assert smem_bytes(256, 512, 4) == 219_408
    assert prefill_flash_unsupported(*args, limits=HOPPER) is None
    for small in (A100, L40S):
        why = prefill_flash_unsupported(*args, limits=small)
        assert "220432 bytes of shared memory" in why and f"{small.arch} allows" in why
    # Fewer selected blocks fit an A100 (the dispatcher then keeps the kernel).
    assert prefill_flash_unsupported(mx.bfloat16, 24, 2, 128, 4, 512, limits=A100) is None


def test_attention_kernels_follow_shared_memory():
    assert attention_unsupported(mx.bfloat16, 24, 2, 256, limits=L40S) is None  # 80 KiB
    why = attention_unsupported(mx.bfloat16, 64, 2, 256, limits=L40S)  # 32 heads per KV head
    assert "split-K attention needs 107520 bytes" in why
    assert attention_unsupported(mx.bfloat16, 64, 2, 256, limits=HOPPER) is None
    # The shape rules come first and do not depend on the GPU.
    assert "bfloat16" in attention_unsupported(mx.float16, 24, 2, 256, limits=HOPPER)


def test_selector_follows_shared_memory():
    assert topk_smem_bytes(65_536) == 4096 * 8 + 4 * 2048
    assert selector_unsupported(mx.bfloat16, 1, 4, 128, 65_536, limits=L40S) is None
    why = selector_unsupported(mx.bfloat16, 1, 4, 128, 1 << 20, limits=L40S)  # 4M tokens
    assert "the top-k pass needs 163840 bytes" in why
    assert selector_unsupported(mx.bfloat16, 1, 4, 128, 1 << 20, limits=HOPPER) is None


def test_topk_shape_by_rows():
    # one CTA a row: 512 threads and 4096 candidates while few rows run (decode, short chunks);
    # from 512 rows on 128 threads and 2048 candidates (24 KB: 8 CTAs an SM), where more rows
    # in flight per SM won (select_sweep.py, H100)
    assert [topk_shape(n) for n in (1, 8, 64, 511)] == [(512, 4096)] * 4
    assert [topk_shape(n) for n in (512, 992, 2048)] == [(128, 2048)] * 3
    assert topk_smem_bytes(8704, 2048) == 2048 * 8 + 4 * 2048


def test_prefill_score_follows_shared_memory():
    q = mx.zeros((1, 4, 8, 128), mx.bfloat16)
    pooled = mx.zeros((1, 64, 128), mx.bfloat16)
    assert SMEM_BYTES == 101_376
    assert prefill_score_supports(q, pooled, limits=L40S)
    assert not prefill_score_supports(q, pooled, limits=DeviceLimits((8, 0), SMEM_BYTES - 1))
    assert not prefill_score_supports(q.astype(mx.float32), pooled, limits=HOPPER)


def test_gemm_family_per_gpu():
    assert family_for_device("tma", None) == "tma"  # no GPU to check against
    assert family_for_device("tma_mc", HOPPER) == "tma_mc"
    assert family_for_device("auto", HOPPER) == "auto"
    assert family_for_device("auto", A100) == "mma"
    assert family_for_device("mma", B200) == "mma"
    for family in ("wgmma", "tma", "tma_mc", "tma_st", "tma_mc_st"):
        with pytest.raises(
            NotImplementedError, match=r"needs sm_90a .* this GPU is sm_80; family 'mma'"
        ):
            family_for_device(family, A100)
    with pytest.raises(RuntimeError, match="sm_80 or newer"):
        family_for_device("mma", T4)
    # The ring depth follows the GPU's shared memory: 64 KiB stages, 3 on sm_90, 2 on sm_80.
    assert plan_gemm((128, 128, 128), 8, family="mma").stages == 3
    assert (
        plan_gemm((128, 128, 128), 8, family="mma", smem_limit=A100.max_shared_memory).stages == 2
    )
    with pytest.raises(NotImplementedError, match="within 101376 bytes"):
        plan_gemm((128, 128, 256), 8, family="mma", smem_limit=L40S.max_shared_memory)


def test_current_without_cuda():
    if mx.cuda.is_available():
        limits = device.current()
        assert limits.compute_capability >= (8, 0) and limits.max_shared_memory >= 101_376
    else:
        assert device.current() is None
        assert device.resolve(None) is None and device.resolve(A100) is A100


def test_dynamic_smem_request_opts_in_near_the_default_limit():
    # small, and already past MLX's opt-in threshold: asked as needed
    assert device.dynamic_smem_request(0) == 0
    assert device.dynamic_smem_request(40_000) == 40_000
    assert device.dynamic_smem_request(82_000) == 82_000
    # dynamic + static past 48 KiB while dynamic <= 48000: MLX would not opt in, so ask above it
    for nbytes in (47_200, 48_000):
        got = device.dynamic_smem_request(nbytes)
        assert got > device.MLX_OPT_IN_ABOVE and got >= nbytes
    # the top-k pass at ~460K tokens (npad 114,720 blocks) is within the guarded band
    top = topk_smem_bytes(114_720)
    assert 49_152 - 2_048 < top <= 48_000
    assert device.dynamic_smem_request(top) > 48_000


def test_counter_slots_rotate():
    from mlx_qsa.bench import primitive_counts
    from mlx_qsa.kernels import _launch

    a, b = _launch.counter_slot(), _launch.counter_slot()
    assert a.shape == (2,) and a.dtype == mx.int32 and not a.any().item()
    assert b is not a
    # made and evaluated once: a step's graph gains no slice or fill for its counters
    assert primitive_counts(_launch.counter_slot())["total"] == 0
    starts = {(_launch._counters["next"] - 1) % _launch._COUNTER_SLOTS}
    for _ in range(_launch._COUNTER_SLOTS - 1):
        _launch.counter_slot()
        starts.add((_launch._counters["next"] - 1) % _launch._COUNTER_SLOTS)
    assert len(starts) == _launch._COUNTER_SLOTS  # every slot used once before any repeats


def test_plans_made_once_per_signature_and_never_for_bad_input(monkeypatch):
    from mlx_qsa.kernels import _launch

    plans, made = _launch.Plans(), []

    def make(tag):
        def mk():
            made.append(tag)
            return lambda arrays: tag

        return mk

    a, b = mx.zeros((2, 3), mx.bfloat16), mx.zeros((2, 3), mx.float32)
    sa, sb = _launch.signature((a,), 0.5), _launch.signature((b,), 0.5)
    assert sa != sb and sa != _launch.signature((a,), 0.25)
    assert plans.get(sa, make("a"))([]) == "a" and plans.get(sa, make("x"))([]) == "a"
    assert made == ["a"]

    def bad():
        raise ValueError("q must be [1, H, S, d]")

    with pytest.raises(ValueError, match="q must be"):
        plans.get(sb, bad)
    assert plans.get(sb, make("b"))([]) == "b"  # the failed plan left nothing behind
    monkeypatch.setattr(_launch, "_PLAN_MAX", 2)
    plans.get(("c",), make("c"))
    assert plans.get(sa, make("a2"))([]) == "a2"  # the oldest plan went first
    assert plans.get(("c",), make("c2"))([]) == "c"


def test_selector_one_launch_rule(set_switch):
    from mlx_qsa.kernels import selector

    small = DeviceLimits((8, 6), 101_376)  # an L40S-class opt-in limit
    assert selector.one_launch_default(2048, HOPPER)
    assert selector.one_launch_default(selector.FUSED_MAX_BLOCKS, HOPPER)
    assert not selector.one_launch_default(selector.FUSED_MAX_BLOCKS + 128, HOPPER)
    # 102400 bytes of scoring CTA do not fit 99 KiB: the two kernels run instead
    assert selector.fused_smem_bytes(2048) > small.max_shared_memory
    assert not selector.one_launch_default(2048, small)
    # one thread per indexer head: 128 staged keys per 512-thread CTA, rows of 132 floats
    assert selector.score_smem_bytes(512, 4) == 64 * 132 * 4 + 128 * 136 * 2
    assert selector.fused_smem_bytes(2048, 4) <= HOPPER.max_shared_memory
    set_switch("MLX_QSA_SELECT_SPLIT_HEADS", None)
    assert not selector.split_heads_env()
    set_switch("MLX_QSA_SELECT_SPLIT_HEADS", "1")
    assert selector.split_heads_env()
    set_switch("MLX_QSA_SELECT_ONE_LAUNCH", None)
    assert selector.select_one_launch_env() is None
    set_switch("MLX_QSA_SELECT_ONE_LAUNCH", "0")
    assert selector.select_one_launch_env() is False
    set_switch("MLX_QSA_SELECT_ONE_LAUNCH", "1")
    assert selector.select_one_launch_env() is True


def test_one_launch_rule(set_switch):
    from mlx_qsa.kernels import _launch

    set_switch("MLX_QSA_ONE_LAUNCH", None)
    assert _launch.one_launch_default(24, 256)  # flash decode: 24 heads x 1 row
    assert _launch.one_launch_default(48, 256)  # 2 verify rows: 48 x 256 = 48 CTAs of mergers
    assert _launch.one_launch_default(64, 256) and not _launch.one_launch_default(65, 256)
    assert not _launch.one_launch_default(24 * 8, 256)  # 8 rows: the merge kernel is faster
    set_switch("MLX_QSA_ONE_LAUNCH", "0")
    assert not _launch.one_launch_default(24, 256)


def test_switches_are_read_once_per_process(monkeypatch, set_switch):
    """A switch set after its first read does not change launches (as MLX's own variables);
    clearing `env_switch` reads it again."""
    from mlx_qsa.kernels import _launch, selector

    set_switch("MLX_QSA_ONE_LAUNCH", "0")
    set_switch("MLX_QSA_SELECT_SPLIT_HEADS", "1")
    assert _launch.one_launch_env() is False and selector.split_heads_env()
    monkeypatch.setenv("MLX_QSA_ONE_LAUNCH", "1")
    monkeypatch.delenv("MLX_QSA_SELECT_SPLIT_HEADS")
    assert _launch.one_launch_env() is False and selector.split_heads_env()
    _launch.env_switch.cache_clear()
    assert _launch.one_launch_env() is None and not selector.split_heads_env()
