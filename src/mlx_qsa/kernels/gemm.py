"""Tensor-core GEMM `y = x · Wᵀ + b` through `mx.fast.cuda_kernel` (device code: `gemm.cuh`).

`x [M, K]`, `W [N, K]`, `b [N]` and `y [M, N]` are bf16; products accumulate in fp32 and the
epilogue is `y = bf16(acc + float(b))`, the order of cuBLASLt's bias epilogue. A configuration is a
block tile `[TM, TN, TK]`, warps per block and `walk_m` (grouped rasterisation, SWEEP.md §4).
Tiles whose warps form whole warpgroups run on `wgmma` (sm_90a); the others run on warp-level
`mma.sync` m16n8k16. Both read a cp.async ring of 128-byte-swizzled shared-memory stages.
Family `tma` is the Hopper design: a persistent grid (one block per SM), one producer warp
feeding TMA tile loads through mbarriers to `warps` consumer warps on wgmma (gemm.cuh); family
`tma_mc` runs it in clusters of two blocks that share each W tile by TMA multicast; family
`tma_st` stages each finished tile in the ring's last stages and writes it with TMA stores, so
the consumers start the next tile while the store drains; `tma_mc_st` is both.

`plan_gemm` and `tile_coords` are pure; MLX is imported only where arrays are made, so that
`mlx_qsa.sweep` can set MLX's precision variables before MLX loads.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx

    from mlx_qsa.kernels.device import DeviceLimits

HEADER = "gemm.cuh"  # device code, included through `header=`
BODIES = "gemm.cu"  # kernel bodies: sections `gemm` (cp.async families) and `gemm_tma`

MAX_DYNAMIC_SMEM = 232_448  # bytes per block on sm_90 (227 KiB)
SMEM_ALIGN_PAD = 1024  # the swizzled stages start on a 1024-byte boundary
MAX_STAGES = 4
MAX_STAGES_TMA = 8
TMA_MAP_BYTES = 128
TMA_BARRIER_BYTES = 2 * 8 * MAX_STAGES_TMA  # full/empty barriers


def _tma_maps(tma_store: bool) -> int:
    """Tensor maps a TMA-family block publishes: x, W (and y for the TMA store)."""
    return 3 if tma_store else 2


def _tma_extra(tma_store: bool) -> int:
    """Shared memory beside the TMA ring: the tensor maps and the barriers (the TMA store
    stages its tile in the ring's last stages)."""
    return _tma_maps(tma_store) * TMA_MAP_BYTES + TMA_BARRIER_BYTES


TMA_MAX_BOX_ROWS = 256
MAX_ACC_REGS = 128  # fp32 accumulators per thread
# Registers are split between an SM's four sub-partitions (16K each; warp w runs on w % 4), so
# with one producer warp beside 8 consumer warps three warps share one and each thread gets at
# most 168. Tiles whose accumulators do not fit that (up to TMA_MAX_ACC_REGS: a 192x192 tile as
# two 192x96 warpgroups has 144) get a producer warpgroup that hands its registers to the
# consumers with setmaxnreg.
TMA_MAX_ACC_REGS = 144
PRODUCER_REGS = 40  # the producer warpgroup's registers after setmaxnreg.dec (a template value)
SUBPARTITION_REGS = 16384
# Addresses, loop state and epilogue temporaries beside the accumulators (NVRTC 13 put the
# 128-accumulator 128x256x64 kernel at 166 registers: benchmarks/gemm_registers.py).
ACC_OVERHEAD_REGS = 40
WGMMA_N = (64, 128, 256)  # warpgroup N extents of the cp.async wgmma family
TMA_WGMMA_N = (64, 96, 128, 192, 256)  # and of the TMA family (every wrapper in gemm.cuh)
FAMILIES = ("auto", "wgmma", "mma", "tma", "tma_mc", "tma_st", "tma_mc_st")
HOPPER_FAMILIES = ("wgmma", "tma", "tma_mc", "tma_st", "tma_mc_st")


@dataclass(frozen=True)
class GemmPlan:
    """One compiled kernel: the configuration plus what the planner derived from it."""

    tile: tuple[int, int, int]
    warps: int
    walk_m: int
    stages: int
    wgmma: bool
    layout_m: int  # warpgroups (wgmma) or warps (mma) stacked along M
    tma: bool = False  # persistent, warp-specialised, TMA-fed (implies wgmma)
    # TMA family: 0 = one producer warp; > 0 = a producer warpgroup that gives registers back
    # (setmaxnreg) so that each consumer thread gets this many.
    consumer_regs: int = 0
    cluster: int = 1  # TMA family: CTAs per cluster; 2 = pairs sharing W tiles by multicast
    tma_store: bool = False  # TMA family: the epilogue stages the tile and stores it by TMA
    # TMA store: boxes of the tile staged in a region after the ring rather than in a second
    # held ring stage (0: the tile's last two stages hold it).
    spare_boxes: int = 0

    @property
    def producer_warps(self) -> int:
        if not self.tma:
            return 0
        return 4 if self.consumer_regs else 1

    @property
    def threads(self) -> int:
        # The TMA family adds its producer warp(s) to the `warps` consumer warps.
        return 32 * (self.warps + self.producer_warps)

    @property
    def stage_bytes(self) -> int:
        tm, tn, tk = self.tile
        return (tm + tn) * tk * 2

    @property
    def maps(self) -> int:
        """Tensor maps the kernel publishes per block: x, W (and y for the TMA store)."""
        return _tma_maps(self.tma_store) if self.tma else 0

    @property
    def shared_memory(self) -> int:
        extra = _tma_extra(self.tma_store) if self.tma else 0
        spare = self.spare_boxes * self.tile[0] * 128
        return self.stages * self.stage_bytes + spare + SMEM_ALIGN_PAD + extra

    @property
    def family(self) -> str:
        if self.tma:
            return ("tma_mc" if self.cluster > 1 else "tma") + ("_st" if self.tma_store else "")
        return "wgmma" if self.wgmma else "mma"

    @property
    def label(self) -> str:
        tm, tn, tk = self.tile
        kind = f"{'tma' if self.tma else self.family}{self.layout_m}"
        if self.cluster > 1:
            kind += f"_c{self.cluster}"
        if self.tma_store:
            kind += f"_st{self.spare_boxes}" if self.spare_boxes else "_st"
        if self.consumer_regs:
            kind += f"_r{self.consumer_regs}"
        return f"{tm}x{tn}x{tk}_w{self.warps}_g{self.walk_m}_s{self.stages}_{kind}"

    def template(self) -> list[tuple[str, int]]:
        tm, tn, tk = self.tile
        names = [("TM", tm), ("TN", tn), ("TK", tk), ("WARPS", self.warps)]
        names += [("WALK_M", self.walk_m), ("STAGES", self.stages)]
        if not self.tma:
            names.append(("WGMMA", int(self.wgmma)))
        names.append(("LAYOUT_M", self.layout_m))
        if self.tma:
            names += [
                ("PRODUCER_REGS", PRODUCER_REGS),
                ("CONSUMER_REGS", self.consumer_regs),
                ("CLUSTER", self.cluster),
                ("TMA_STORE", int(self.tma_store)),
                ("SPARE_BOXES", self.spare_boxes),
            ]
        return names

    def tiles(self, m: int, n: int) -> int:
        tm, tn, _ = self.tile
        return -(-m // tm) * -(-n // tn)

    def blocks(self, m: int, n: int, sms: int = 0) -> int:
        """Thread blocks launched: one per tile, or (TMA family) at most one per SM.

        With clusters of c CTAs the schedule's units are c vertically adjacent tiles (the last
        unit of a column may reach below M) and the grid is whole clusters.
        """
        if self.tma:
            if sms < 1:
                raise ValueError(
                    f"GemmPlan.blocks(sms): the TMA family needs the SM count, got {sms}"
                )
            tm, tn, _ = self.tile
            c = self.cluster
            tiles_m = -(-m // tm)
            units = -(-tiles_m // c) * -(-n // tn)
            return c * min(units, sms // c)
        return self.tiles(m, n)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _wgmma_layout(
    tm: int,
    tn: int,
    warps: int,
    max_acc: int = MAX_ACC_REGS,
    extents: tuple[int, ...] = WGMMA_N,
) -> int | None:
    """Warpgroups along M for the widest warpgroup N extent that fits, or None."""
    if warps % 4:
        return None
    groups = warps // 4
    best: tuple[int, int] | None = None
    for lm in _divisors(groups):
        wgn = groups // lm
        if tm % (64 * lm) or tn % wgn:
            continue
        wg_tn = tn // wgn
        if wg_tn not in extents or (tm // lm // 64) * (wg_tn // 2) > max_acc:
            continue
        if best is None or wg_tn > best[0]:
            best = (wg_tn, lm)
    return None if best is None else best[1]


def _mma_layout(tm: int, tn: int, warps: int) -> int | None:
    """Warps along M giving the squarest warp tile that fits, or None."""
    best: tuple[int, int, int] | None = None
    for lm in _divisors(warps):
        wn = warps // lm
        if tm % (16 * lm) or tn % (16 * wn):
            continue
        wtm, wtn = tm // lm, tn // wn
        if (wtm // 16) * (wtn // 8) * 4 > MAX_ACC_REGS:
            continue
        score = (abs(wtm - wtn), -wtm, lm)
        if best is None or score < best:
            best = score
    return None if best is None else best[2]


def plan_gemm(
    tile: tuple[int, int, int] | list[int],
    warps: int,
    walk_m: int = 0,
    *,
    stages: int | None = None,
    family: str = "auto",
    smem_limit: int = MAX_DYNAMIC_SMEM,
) -> GemmPlan:
    """Choose the kernel family, warp layout and pipeline depth for one configuration.

    `smem_limit` is the GPU's opt-in shared memory per block (default: sm_90's). Raises
    ValueError for malformed values and NotImplementedError for configurations this kernel
    family cannot run (no warp layout, loads that do not divide over the block, or shared
    memory above the per-block limit).
    """
    if len(tile) != 3 or any(int(v) != v or v <= 0 for v in tile):
        raise ValueError(f"plan_gemm(tile): expected three positive ints [TM, TN, TK], got {tile}")
    tm, tn, tk = (int(v) for v in tile)
    if warps not in (1, 2, 4, 8, 12, 16):
        raise ValueError(f"plan_gemm(warps): expected 1, 2, 4, 8, 12 or 16, got {warps}")
    if walk_m < 0:
        raise ValueError(f"plan_gemm(walk_m): expected >= 0, got {walk_m}")
    if family not in FAMILIES:
        raise ValueError(f"plan_gemm(family): expected one of {FAMILIES}, got {family!r}")
    if tk % 64:
        raise ValueError(f"plan_gemm(tile): TK must be a multiple of 64 (swizzle atom), got {tk}")
    if family.startswith("tma"):
        return _plan_tma(
            tm,
            tn,
            tk,
            warps,
            walk_m,
            stages,
            cluster=2 if family.startswith("tma_mc") else 1,
            tma_store=family.endswith("_st"),
        )
    if warps == 12:
        # Three warpgroups only make sense beside a producer: 192-row tiles as three 64-row
        # warpgroups, each one m64n(TN) wgmma per k-step.
        raise NotImplementedError(
            f"tile {[tm, tn, tk]} / 12 warps: three consumer warpgroups need a tma family"
        )
    threads = 32 * warps
    # gemm.cuh's loader: each thread keeps one 16-byte column chunk, rows threads/chunks apart.
    chunks = tk // 8
    if threads % chunks or tm % (threads // chunks) or tn % (threads // chunks):
        raise NotImplementedError(
            f"tile {[tm, tn, tk]} / {warps} warps: 16-byte loads do not divide over "
            f"{threads} threads"
        )

    wg = _wgmma_layout(tm, tn, warps) if family in ("auto", "wgmma") else None
    mm = _mma_layout(tm, tn, warps) if family in ("auto", "mma") and wg is None else None
    if wg is None and mm is None:
        raise NotImplementedError(
            f"tile {[tm, tn, tk]} / {warps} warps: no {family} warp layout within "
            f"{MAX_ACC_REGS} accumulators per thread"
        )

    return GemmPlan(
        tile=(tm, tn, tk),
        warps=warps,
        walk_m=walk_m,
        stages=_stages(
            (tm, tn, tk), stages, least=1, default_cap=MAX_STAGES, extra=0, limit=smem_limit
        ),
        wgmma=wg is not None,
        layout_m=wg if wg is not None else mm,
    )


@functools.lru_cache(maxsize=256)
def _cached_plan(
    tile: tuple, warps: int, walk_m: int, stages: int | None, family: str, smem: int
) -> GemmPlan:
    """`plan_gemm` once per configuration (a call of `gemm_bias` would spend ~9 µs on it)."""
    return plan_gemm(tile, warps, walk_m, stages=stages, family=family, smem_limit=smem)


def _stages(
    tile: tuple[int, int, int],
    stages: int | None,
    *,
    least: int,
    default_cap: int,
    extra: int,
    limit: int = MAX_DYNAMIC_SMEM,
) -> int:
    """Ring depth: `stages`, or as many stages as fit (at most `default_cap`) when None.

    A stage holds one [TM, TK] slab of x and one [TN, TK] slab of W in bf16; `extra` bytes of
    shared memory (tensor maps, barriers) sit beside the ring.
    """
    tm, tn, tk = tile
    stage_bytes = (tm + tn) * tk * 2
    fit = (limit - SMEM_ALIGN_PAD - extra) // stage_bytes
    if stages is None:
        stages = min(default_cap, fit)
    if not least <= stages <= fit:
        raise NotImplementedError(
            f"tile {list(tile)}: needs {least}..{max(fit, least)} stages of {stage_bytes} bytes "
            f"within {limit} bytes of shared memory (at most {fit} fit), got {stages}"
        )
    return stages


def _plan_tma(
    tm: int,
    tn: int,
    tk: int,
    warps: int,
    walk_m: int,
    stages: int | None,
    cluster: int = 1,
    tma_store: bool = False,
) -> GemmPlan:
    if tma_store and tn % 64:
        raise NotImplementedError(
            f"tile {[tm, tn, tk]}: the TMA store writes 64-column boxes; TN must be a "
            f"multiple of 64"
        )
    layout = _wgmma_layout(tm, tn, warps, TMA_MAX_ACC_REGS, TMA_WGMMA_N)
    if layout is None:
        raise NotImplementedError(
            f"tile {[tm, tn, tk]} / {warps} warps: the tma family needs whole consumer "
            f"warpgroups with a wgmma layout within {TMA_MAX_ACC_REGS} accumulators per thread"
        )
    if max(tm, tn) > TMA_MAX_BOX_ROWS:
        raise NotImplementedError(
            f"tile {[tm, tn, tk]}: a TMA box spans at most {TMA_MAX_BOX_ROWS} rows"
        )
    if stages is not None and stages > MAX_STAGES_TMA:
        raise NotImplementedError(
            f"tile {[tm, tn, tk]}: the tma family has barriers for at most {MAX_STAGES_TMA} "
            f"stages, got {stages}"
        )
    # One stage on the tensor cores and one loading: fewer than two stages cannot overlap.
    ring = _stages(
        (tm, tn, tk),
        stages,
        least=2,
        default_cap=MAX_STAGES_TMA,
        extra=_tma_extra(tma_store),
    )
    groups = warps // 4
    acc = (tm // layout // 64) * (tn // (groups // layout) // 2)
    need = acc + ACC_OVERHEAD_REGS
    # One producer warp: ceil((warps + 1) / 4) warps share a sub-partition.
    plain = min(255, SUBPARTITION_REGS // 32 // -(-(warps + 1) // 4)) // 8 * 8
    consumer_regs = 0
    if need > plain:
        # A producer warpgroup: one producer and `groups` consumer warps per sub-partition.
        budget = (SUBPARTITION_REGS // 32 - PRODUCER_REGS) // groups // 8 * 8
        consumer_regs = min(256, budget)
        if consumer_regs < need:
            raise NotImplementedError(
                f"tile {[tm, tn, tk]} / {warps} warps: {acc} accumulators per thread need "
                f"about {need} registers; {groups} consumer warpgroups get at most "
                f"{max(plain, consumer_regs)}"
            )
    return GemmPlan(
        tile=(tm, tn, tk),
        warps=warps,
        walk_m=walk_m,
        stages=ring,
        spare_boxes=_spare_boxes(tm, tn, tk, ring) if tma_store else 0,
        wgmma=True,
        layout_m=layout,
        tma=True,
        consumer_regs=consumer_regs,
        cluster=cluster,
        tma_store=tma_store,
    )


def _spare_boxes(tm: int, tn: int, tk: int, stages: int, limit: int = MAX_DYNAMIC_SMEM) -> int:
    """64-column boxes of a finished tile beyond one ring stage's, when they fit after the
    ring (gemm.cuh's SPARE_BOXES): the tile then keeps one stage during its epilogue instead of
    two, and the producer has the other stages for the next tile. 0 when one stage holds the
    tile, when the rest would need more than one more stage's worth, or when no room is left."""
    stage = (tm + tn) * tk * 2
    per_stage = stage // (tm * 128)
    boxes = tn // 64
    spare = boxes - per_stage
    if spare <= 0 or spare > per_stage:
        return 0
    need = stages * stage + spare * tm * 128 + SMEM_ALIGN_PAD + _tma_extra(True)
    return spare if need <= limit else 0


def tile_coords(pid: int, tiles_m: int, tiles_n: int, walk_m: int) -> tuple[int, int]:
    """Block `pid` -> (tile_m, tile_n), the rasterisation of SWEEP.md §4 (same as gemm.cuh)."""
    if walk_m == 0:
        return pid // tiles_n, pid % tiles_n
    span = walk_m * tiles_n
    first = (pid // span) * walk_m
    g = min(tiles_m - first, walk_m)
    r = pid % span
    return first + r % g, r // g


def launch_bounds_header(threads: int, cluster: int = 1) -> str:
    """Header text that puts `__launch_bounds__(threads, 1)` (and, for cluster > 1,
    `__cluster_dims__(cluster, 1, 1)`) on MLX's generated kernel.

    `mx.fast.cuda_kernel` writes the kernel as `__global__ void <name>(...)` right after the
    header and takes neither attribute, so NVRTC may give each thread more registers than a
    block of `threads` can hold (the launch then fails: "too many resources requested"), and
    the kernel cannot ask for clusters. Redefining `__global__` (crt/host_defines.h:
    `__location__(global)`) at the end of the header reaches that one definition; a kernel with
    compile-time cluster dimensions launches as clusters through an ordinary launch.
    """
    attrs = f"__launch_bounds__({threads}, 1)"
    if cluster > 1:
        attrs += f" __cluster_dims__({cluster}, 1, 1)"
    return f"\n#undef __global__\n#define __global__ __location__(global) {attrs}\n"


def kernel_text(plan: GemmPlan) -> tuple[str, str]:
    """(header, body) that `_kernel` hands to `mx.fast.cuda_kernel` for `plan`: the header
    defines `QSA_WGMMA` and includes gemm.cuh (`_launch.include`: MLX copies and hashes this
    text on every call), the body declares the plan's constants (`GemmPlan.template`) and runs
    gemm.cu's section for the family. MLX would format a `template=` list into the text on
    every call; one kernel per plan has them fixed."""
    from mlx_qsa.kernels._launch import constants, include, kernel_sections

    n = wgmma_n(plan)
    # the mma.sync family issues no wgmma: its macro names no wrapper
    header = (
        f"#define QSA_WGMMA qsa_wgmma_n{n}\n" if n else "#define QSA_WGMMA(d, da, db)\n"
    ) + include(HEADER)
    consts = constants(tuple(plan.template()))
    bodies = kernel_sections(BODIES)
    if plan.tma:
        header += launch_bounds_header(plan.threads, plan.cluster)
        return header, consts + bodies["gemm_tma"]
    return header, consts + bodies["gemm"]


def wgmma_n(plan: GemmPlan) -> int | None:
    """The N extent of each consumer warpgroup's wgmma (gemm.cuh's WG_TN), which names the one
    `qsa_wgmma_n<N>` wrapper the kernel uses; None for the mma.sync family."""
    if not plan.wgmma:
        return None
    groups = plan.warps // 4
    n = plan.tile[1] // (groups // plan.layout_m)
    if n not in TMA_WGMMA_N:
        raise NotImplementedError(f"wgmma N extent {n}: gemm.cuh wraps only {TMA_WGMMA_N}")
    return n


@functools.cache
def _kernel(plan: GemmPlan):
    import mlx.core as mx

    from mlx_qsa.kernels._launch import _digest, included_text

    header, source = kernel_text(plan)
    digest = _digest(header, included_text(header), source)
    # MLX caches compiled modules by name (in memory and in MLX_PTX_CACHE_DIR), so the name
    # carries the whole key and the digest of the text it compiles.
    return mx.fast.cuda_kernel(
        name=f"qsa_gemm_{plan.label}_{digest}",
        input_names=["x", "w", "b", "tmaps"] if plan.tma else ["x", "w", "b"],
        output_names=["y", "scratch"] if plan.tma else ["y"],
        source=source,
        header=header,
        ensure_row_contiguous=True,
        shared_memory=plan.shared_memory,
    )


@functools.lru_cache(maxsize=256)
def _tensor_maps(m: int, n: int, k: int, box_m: int, box_n: int, store: bool = False):
    """x's and W's tensor-map templates (and, with `store`, y's: boxes of 64 columns x `box_m`
    rows) as one uint64 array [32] or [48], in the order gemm.cuh reads them.

    Made once per geometry (at most 256 kept), as a GPU-made copy: an array made from host data
    lives in MLX's managed memory (device_arrays), and the first kernel to read such an array
    waits for its page (H100: that call took 565 instead of ~375 µs)."""
    import mlx.core as mx
    import numpy as np

    from mlx_qsa.device_arrays import device_constant
    from mlx_qsa.kernels import tensormap

    raw = tensormap.encode_bf16_rows(m, k, box_m) + tensormap.encode_bf16_rows(n, k, box_n)
    if store:
        raw += tensormap.encode_bf16_rows(m, n, box_m)
    return device_constant(mx.array(np.frombuffer(raw, dtype=np.uint64).copy()))


def _check_inputs(x: mx.array, w: mx.array, b: mx.array) -> None:
    import mlx.core as mx

    for name, a, nd in (("x", x, 2), ("w", w, 2), ("b", b, 1)):
        if a.ndim != nd:
            raise ValueError(f"gemm_bias({name}): expected {nd} dimensions, got shape {a.shape}")
        if a.dtype != mx.bfloat16:
            raise ValueError(f"gemm_bias({name}): expected bfloat16, got {a.dtype}")
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"gemm_bias(w): expected [N, K={k}], got {w.shape}")
    if b.shape[0] != n:
        raise ValueError(f"gemm_bias(b): expected [N={n}], got {b.shape}")
    if m < 1 or n < 1:
        raise ValueError(f"gemm_bias: M and N must be >= 1, got M={m}, N={n}")
    if k % 8 or n % 8:
        raise ValueError(
            f"gemm_bias: K and N must be multiples of 8 (16-byte rows), got K={k}, N={n}"
        )


def gemm_bias(
    x: mx.array,
    w: mx.array,
    b: mx.array,
    *,
    tile: tuple[int, int, int] = (128, 128, 64),
    warps: int = 4,
    walk_m: int = 8,
    stages: int | None = None,
    family: str = "auto",
    init_value: float | None = None,
) -> mx.array:
    """`x [M, K] · w[N, K]ᵀ + b [N] -> y [M, N]`, bf16, on the custom CUDA kernel.

    `init_value` fills `y` before the kernel runs (tests poison it with NaN). Checks, the plan,
    the tensor maps and the launch arguments are made once per signature (`_launch.Plans`);
    later calls with the same shapes and options only launch.
    """
    opts = (tuple(tile), warps, walk_m, stages, family, init_value)
    # `_launch.signature`'s fields, written out: no generator on a call's host path
    sig = (x.shape, x.dtype, w.shape, w.dtype, b.shape, b.dtype) + opts
    return _runs().get(sig, lambda: _plan_run(x, w, b, *opts))(x, w, b)


@functools.cache
def _runs():
    """The planned `gemm_bias` launches by signature (`_launch.Plans`, made on first use)."""
    from mlx_qsa.kernels._launch import Plans

    return Plans()


def _plan_run(x, w, b, tile, warps, walk_m, stages, family, init_value):
    """The run of one `gemm_bias` signature: checks, plan, kernel, tensor maps, launch shape."""
    import mlx.core as mx

    if not mx.cuda.is_available():
        raise RuntimeError(
            "gemm_bias needs MLX with its CUDA backend (mx.cuda.is_available() is False)"
        )
    _check_inputs(x, w, b)
    from mlx_qsa.kernels import device

    limits = device.current()
    family = family_for_device(family, limits)
    smem = limits.max_shared_memory if limits is not None else MAX_DYNAMIC_SMEM
    plan = _cached_plan(tile, warps, walk_m, stages, family, smem)
    if plan.cluster > 1:
        from mlx_qsa.kernels._launch import env_switch

        if (why := cluster_launch_unsupported(env_switch("MLX_USE_CUDA_GRAPHS"))) is not None:
            raise NotImplementedError(f"gemm_bias(family={family!r}): {why}")
    m, n = x.shape[0], w.shape[0]
    threads = plan.threads
    kernel = _kernel(plan)
    block = (threads, 1, 1)
    if plan.tma:
        blocks = plan.blocks(m, n, device.sm_count())
        tm, tn, _ = plan.tile
        extra = [_tensor_maps(m, n, x.shape[1], tm, tn // plan.cluster, plan.tma_store)]
        # Each block publishes its tensor maps into its slot of `scratch`, 128 bytes a map
        # (+128 bytes so the kernel can align the slots).
        shapes = [(m, n), (TMA_MAP_BYTES * plan.maps * blocks + 128,)]
        dtypes = [mx.bfloat16, mx.uint8]
    else:
        blocks = plan.blocks(m, n)
        if blocks * threads > 2**31 - 1:
            raise ValueError(f"gemm_bias: {blocks} blocks exceed the launch limit")
        extra, shapes, dtypes = [], [(m, n)], [mx.bfloat16]
    grid = (blocks * threads, 1, 1)

    def run(x, w, b):
        return kernel(
            inputs=[x, w, b, *extra],
            output_shapes=shapes,
            output_dtypes=dtypes,
            grid=grid,
            threadgroup=block,
            init_value=init_value,
        )[0]

    return run


def cluster_launch_unsupported(use_cuda_graphs: str | None) -> str | None:
    """Why a cluster kernel (families `tma_mc`, `tma_mc_st`) cannot run in this process, or
    None; `use_cuda_graphs` is the value of MLX_USE_CUDA_GRAPHS (None: unset).

    Seen on the H100 (2026-12-06, `benchmarks/gemm_st_order.py`): after one cluster GEMM call
    in a process, every later one-block `tma_st` call left y unwritten, while 132-block calls
    and `tma_st` before any cluster call were exact. The probable cause, in MLX 0.32's
    `subgraph_to_key` (backend/cuda/device.cpp): MLX reuses a CUDA graph whose key matches and
    updates its kernel nodes in place, and its own comment says CUDA does not update a node
    correctly into one of another cluster shape; the key tells shapes apart only by the node's
    launch attribute, which compile-time `__cluster_dims__` (the only way
    `mx.fast.cuda_kernel` can launch clusters) does not set. Without MLX's CUDA graphs
    (MLX_USE_CUDA_GRAPHS=0, read once per process, as MLX's `atoi`) no node is updated.
    """
    if use_cuda_graphs is not None:
        # atoi: leading blanks, a sign, then digits; no digits reads as 0
        number = re.match(r"\s*[+-]?\d+", use_cuda_graphs)
        if number is None or int(number.group()) == 0:
            return None
    return (
        "cluster kernels need MLX_USE_CUDA_GRAPHS=0: MLX updates CUDA graph nodes in place "
        "without seeing compile-time cluster dimensions, which then leak into later launches "
        "of other kernels"
    )


def family_for_device(family: str, limits: DeviceLimits | None) -> str:
    """The family to plan on a GPU with `limits` (None: unchecked).

    The `wgmma` and `tma*` families are Hopper code (sm_90a): elsewhere they raise, and `auto`
    means `mma` (mma.sync, sm_80 and newer).
    """
    from mlx_qsa.kernels import device

    if limits is None:
        return family
    if (why := device.kernels_unsupported(limits)) is not None:
        raise RuntimeError(f"gemm_bias: {why}")
    if (why := device.hopper_unsupported(limits)) is None:
        return family
    if family == "auto":
        return "mma"
    if family in HOPPER_FAMILIES:
        raise NotImplementedError(f"gemm_bias(family={family!r}): {why}; family 'mma' runs here")
    return family


def gemm_bias_reference(x: mx.array, w: mx.array, b: mx.array) -> mx.array:
    """Portable twin of `gemm_bias`: MLX's built-in matmul with its bias epilogue."""
    import mlx.core as mx

    return mx.addmm(b, x, w.T)
