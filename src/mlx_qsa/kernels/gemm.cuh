// GEMM y = x · Wᵀ + b for mx.fast.cuda_kernel (bf16 in and out, fp32 accumulation, bf16 bias
// epilogue): the device code. Launcher: gemm.py; kernel bodies: gemm.cu. MLX gets this file as
// an `#include` line in `header=` (the text MLX copies and hashes on every call stays short),
// after a `#define QSA_WGMMA` naming the plan's wgmma wrapper.
//
// Shared memory: per stage an x tile [TM, TK] then a W tile [TN, TK], each stored as TK/64
// column atoms of 128-byte rows with the 128-byte swizzle (16-byte chunk c of row r at chunk
// c ^ (r % 8)), the layout wgmma reads through a K-major SW128 descriptor and ldmatrix reads
// without bank conflicts. Both are filled by cp.async (zero-filled outside M, N and K).

__device__ __forceinline__ unsigned qsa_smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void qsa_cp_async16(unsigned dst, const void* src, bool valid) {
  int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void qsa_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void qsa_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Orders this thread's completed generic-proxy shared writes (cp.async) before later
// async-proxy reads (wgmma) of other threads that pass the following barrier.
__device__ __forceinline__ void qsa_fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` inside one 128B-swizzled atom.
__device__ __forceinline__ unsigned qsa_swz(int row, int chunk) {
  return static_cast<unsigned>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// Copies rows [row0, row0 + ROWS) x columns [k0, k0 + TK) of a row-major [rows, K] bf16 matrix
// into one swizzled stage tile at shared address `dst`. Each thread keeps one 16-byte column
// chunk and walks rows RSTEP apart with one pointer, so few addresses stay live across the loop.
template <int ROWS, int TK, int THREADS>
__device__ __forceinline__ void qsa_load_tile(unsigned dst, const __nv_bfloat16* src, int rows,
                                              int K, int row0, int k0, int tid) {
  constexpr int CHUNKS = TK / 8;  // 16-byte chunks per row
  static_assert(THREADS % CHUNKS == 0, "a block row of threads must cover whole tile rows");
  constexpr int RSTEP = THREADS / CHUNKS;
  static_assert(ROWS % RSTEP == 0, "tile rows must divide evenly over the block");
  const int c = tid % CHUNKS;
  const int r0 = tid / CHUNKS;
  const int gk = k0 + c * 8;
  const bool kvalid = gk < K;
  const __nv_bfloat16* p = src + static_cast<long long>(row0 + r0) * K + gk;
  const long long step = static_cast<long long>(RSTEP) * K;
  const unsigned d0 = dst + static_cast<unsigned>((c >> 3) * ROWS * 128 + r0 * 128);
  const int cl = c & 7;
#pragma unroll
  for (int it = 0; it < ROWS / RSTEP; ++it) {
    const int r = r0 + it * RSTEP;
    const int sw = (RSTEP % 8 == 0) ? (r0 & 7) : (r & 7);
    const bool valid = kvalid && (row0 + r < rows);
    qsa_cp_async16(d0 + static_cast<unsigned>(it * RSTEP * 128 + ((cl ^ sw) << 4)),
                   valid ? p : src, valid);
    p += step;
  }
}

// ---- warpgroup MMA (sm_90a) ----

// K-major operand with the 128-byte swizzle: rows 128 bytes apart, 8-row groups 1024 bytes
// apart (stride byte offset), leading byte offset unused (encoded 1).
__device__ __forceinline__ unsigned long long qsa_desc_sw128(unsigned addr) {
  unsigned long long d = 0;
  d |= static_cast<unsigned long long>((addr & 0x3FFFF) >> 4);
  d |= static_cast<unsigned long long>(1) << 16;
  d |= static_cast<unsigned long long>(1024 >> 4) << 32;
  d |= static_cast<unsigned long long>(1) << 62;
  return d;
}

__device__ __forceinline__ void qsa_wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void qsa_wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void qsa_wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator accesses across a wgmma wait.
__device__ __forceinline__ void qsa_reg_fence(float& r) {
  asm volatile("" : "+f"(r)::"memory");
}

// One m64nNk16 wgmma (bf16 in, f32 accumulators d[0..N/2), both operands from shared memory
// by descriptor) per N extent a plan can use (gemm.py TMA_WGMMA_N). The asm operand lists are
// built from these: the accumulators 8 at a time, their "%i" names 16 at a time.
#define QSA_ACC8(b)                                                                            \
  "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), \
      "+f"(d[b + 6]), "+f"(d[b + 7])
#define QSA_ACC32(b) QSA_ACC8(b), QSA_ACC8(b + 8), QSA_ACC8(b + 16), QSA_ACC8(b + 24)
#define QSA_R0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define QSA_R16 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define QSA_R32 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define QSA_R48 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define QSA_R64 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define QSA_R80 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define QSA_R96 \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define QSA_R112 \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
// qsa_wgmma_n<N>(d, da, db): REGS names the N / 2 accumulators, DESCS the two descriptors'
// operands (the next two numbers), the rest lists the accumulators themselves.
#define QSA_WGMMA_WRAPPER(N, REGS, DESCS, ...)                                                \
  __device__ __forceinline__ void qsa_wgmma_n##N(float (&d)[N / 2], unsigned long long da,   \
                                                 unsigned long long db) {                    \
    asm volatile("{\n"                                                                       \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 "                  \
                 "{" REGS "},"                                                               \
                 " " DESCS ", 1, 1, 1, 0, 0;\n"                                              \
                 "}\n"                                                                       \
                 : __VA_ARGS__                                                               \
                 : "l"(da), "l"(db));                                                        \
  }

QSA_WGMMA_WRAPPER(64, QSA_R0 ", " QSA_R16, "%32, %33", QSA_ACC32(0))
QSA_WGMMA_WRAPPER(96, QSA_R0 ", " QSA_R16 ", " QSA_R32, "%48, %49", QSA_ACC32(0),
                  QSA_ACC8(32), QSA_ACC8(40))
QSA_WGMMA_WRAPPER(128, QSA_R0 ", " QSA_R16 ", " QSA_R32 ", " QSA_R48, "%64, %65", QSA_ACC32(0),
                  QSA_ACC32(32))
QSA_WGMMA_WRAPPER(192,
                  QSA_R0 ", " QSA_R16 ", " QSA_R32 ", " QSA_R48 ", " QSA_R64 ", " QSA_R80,
                  "%96, %97", QSA_ACC32(0), QSA_ACC32(32), QSA_ACC32(64))
QSA_WGMMA_WRAPPER(256,
                  QSA_R0 ", " QSA_R16 ", " QSA_R32 ", " QSA_R48 ", " QSA_R64 ", " QSA_R80
                  ", " QSA_R96 ", " QSA_R112,
                  "%128, %129", QSA_ACC32(0), QSA_ACC32(32), QSA_ACC32(64), QSA_ACC32(96))
#undef QSA_WGMMA_WRAPPER
#undef QSA_ACC8
#undef QSA_ACC32
#undef QSA_R0
#undef QSA_R16
#undef QSA_R32
#undef QSA_R48
#undef QSA_R64
#undef QSA_R80
#undef QSA_R96
#undef QSA_R112

// QSA_WGMMA(d, da, db) is the plan's qsa_wgmma_n<N>: gemm.py's kernel_text defines it in front
// of this file.

// ---- warp MMA (mma.sync m16n8k16, any sm_80+) ----

__device__ __forceinline__ void qsa_ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void qsa_mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                              unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// bf16(acc + bias) for one accumulator pair: the rounding of every epilogue.
__device__ __forceinline__ __nv_bfloat162 qsa_bias_pair(__nv_bfloat162 bias, float v0, float v1) {
  __nv_bfloat162 out;
  out.x = __float2bfloat16_rn(v0 + __bfloat162float(bias.x));
  out.y = __float2bfloat16_rn(v1 + __bfloat162float(bias.y));
  return out;
}

// Epilogue for one accumulator pair: y[row, col:col+2] = bf16(acc + bias).
__device__ __forceinline__ void qsa_store_pair(__nv_bfloat16* y, __nv_bfloat162 bias, int M,
                                               int N, int row, int col, float v0, float v1) {
  if (row < M && col < N) {
    *reinterpret_cast<__nv_bfloat162*>(y + static_cast<long long>(row) * N + col) =
        qsa_bias_pair(bias, v0, v1);
  }
}

// One k-slice of a warpgroup's m64nN wgmmas, committed as one group: the stage holds TK/64
// swizzle atoms of A (TM rows of 128 bytes each) then of B (TN rows); this warpgroup's rows of
// A start at row_a, its rows of B at row_b.
template <int TM, int TN, int TK, int MI, int NN>
__device__ __forceinline__ void qsa_wgmma_kslice(float (&acc)[MI][NN / 2], unsigned a_base,
                                                 unsigned b_base, int row_a, int row_b) {
  qsa_wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < TK / 16; ++ks) {
    const unsigned atom = static_cast<unsigned>(ks >> 2);
    const unsigned kin = static_cast<unsigned>((ks & 3) * 32);
    const unsigned long long db =
        qsa_desc_sw128(b_base + atom * (TN * 128) + static_cast<unsigned>(row_b * 128) + kin);
#pragma unroll
    for (int i = 0; i < MI; ++i) {
      const unsigned long long da = qsa_desc_sw128(
          a_base + atom * (TM * 128) + static_cast<unsigned>((row_a + i * 64) * 128) + kin);
      QSA_WGMMA(acc[i], da, db);
    }
  }
  qsa_wgmma_commit();
}

// The bias pairs of a thread's accumulator columns col0 + 8j + 2(lane%4), j < J, all loaded up
// front: as far as the compiler knows y may alias b, so a bias load placed after a store to y
// waits for that store, and interleaving them serialises the epilogue on load latency.
template <int J>
__device__ __forceinline__ void qsa_load_bias(__nv_bfloat162 (&bias)[J], const __nv_bfloat16* b,
                                              int N, int col0, int lane) {
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int col = col0 + j * 8 + 2 * (lane & 3);
    bias[j] = col < N ? *reinterpret_cast<const __nv_bfloat162*>(b + col)
                      : __floats2bfloat162_rn(0.0f, 0.0f);
  }
}

// The epilogue's walk over one warp's share of m64nN accumulators (MI of them, stacked 64 rows
// apart): warp q of the warpgroup holds rows 16q + lane/4 (+8); registers 4j..4j+3 hold columns
// 8j + 2(lane%4) (+1), counted from the warp's first column, whose column in y is gcol0. Bias
// pairs load CHUNK at a time ahead of their stores: one load latency per chunk, for CHUNK
// registers; or, given `pre` (all NN/8 pairs, loaded by the caller before the tile's k-loop so
// that their latency hides behind it), none. `put(r, c, bias, v0, v1)` takes each accumulator
// pair with its row offset r (64 i + 8 h) and column offset c from the warp's first row and
// column.
template <int NN>
constexpr int qsa_bias_chunk() {
  return (NN / 8) % 8 == 0 ? 8 : (NN / 8) % 6 == 0 ? 6 : (NN / 8) % 4 == 0 ? 4 : NN / 8;
}

// Bias pairs jc .. jc + CHUNK - 1 of the walk below: from `pre`, or loaded now.
template <int CHUNK>
__device__ __forceinline__ void qsa_bias_for(__nv_bfloat162 (&bias)[CHUNK],
                                             const __nv_bfloat162* pre, int jc,
                                             const __nv_bfloat16* b, int N, int gcol0, int lane) {
  if (pre != nullptr) {
#pragma unroll
    for (int jj = 0; jj < CHUNK; ++jj) {
      bias[jj] = pre[jc + jj];
    }
  } else {
    qsa_load_bias(bias, b, N, gcol0 + jc * 8, lane);
  }
}

// The epilogue's walk over a warpgroup tile's accumulators: bias chunk by chunk (from `pre`, or
// loaded per chunk), then visit(i, j, bias) for each 64-row slice i and each STEP-th column
// group j of the chunk, `bias` pointing at group j's bias pair.
template <int MI, int NN, int STEP, typename Visit>
__device__ __forceinline__ void qsa_epilogue_walk(const __nv_bfloat16* b, int N, int gcol0,
                                                  int lane, const __nv_bfloat162* pre,
                                                  Visit visit) {
  constexpr int J = NN / 8;
  constexpr int CHUNK = qsa_bias_chunk<NN>();
  static_assert(CHUNK % STEP == 0, "whole steps per bias chunk");
#pragma unroll
  for (int jc = 0; jc < J; jc += CHUNK) {
    __nv_bfloat162 bias[CHUNK];
    qsa_bias_for(bias, pre, jc, b, N, gcol0, lane);
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int jj = 0; jj < CHUNK; jj += STEP) {
        visit(i, jc + jj, bias + jj);
      }
    }
  }
}

// put(r, c, bias, v0, v1) for each accumulator pair: row r, columns c and c + 1 of the warp's
// 64-row slices (r from the lane's first row, c from the warp's first column).
template <int MI, int NN, typename Put>
__device__ __forceinline__ void qsa_wgmma_epilogue(const __nv_bfloat16* b, int N, int gcol0,
                                                   int lane, float (&acc)[MI][NN / 2], Put put,
                                                   const __nv_bfloat162* pre = nullptr) {
  auto pairs = [&](int i, int j, const __nv_bfloat162* bias) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      put(i * 64 + 8 * h, j * 8 + 2 * (lane & 3), bias[0], acc[i][4 * j + 2 * h],
          acc[i][4 * j + 2 * h + 1]);
    }
  };
  qsa_epilogue_walk<MI, NN, 1>(b, N, gcol0, lane, pre, pairs);
}

// The same walk two column groups at a time, for stmatrix: put4(r, c, v) takes the packed
// bf16(acc + bias) pairs of column groups c/8 and c/8 + 1 (c a multiple of 16 from the warp's
// first column), rows r and r + 8 each: v = {(c, r), (c, r + 8), (c + 8, r), (c + 8, r + 8)},
// the four 8x8 fragments of one stmatrix.x4 in the accumulator's own layout.
template <int MI, int NN, typename Put4>
__device__ __forceinline__ void qsa_wgmma_epilogue_x4(const __nv_bfloat16* b, int N, int gcol0,
                                                      int lane, float (&acc)[MI][NN / 2],
                                                      Put4 put4,
                                                      const __nv_bfloat162* pre = nullptr) {
  auto fragments = [&](int i, int j, const __nv_bfloat162* bias) {
    unsigned v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int jq = j + (q >> 1);  // fragments 0, 1: group j; 2, 3: group j + 1
      const int h = q & 1;          // rows r (0, 2) or r + 8 (1, 3)
      const __nv_bfloat162 p =
          qsa_bias_pair(bias[q >> 1], acc[i][4 * jq + 2 * h], acc[i][4 * jq + 2 * h + 1]);
      v[q] = *reinterpret_cast<const unsigned*>(&p);
    }
    put4(i * 64, j * 8, v);
  };
  qsa_epilogue_walk<MI, NN, 2>(b, N, gcol0, lane, pre, fragments);
}

// Register-store epilogue: y[row0 + r, col0 + c : +2] = bf16(acc + bias), inside M and N.
template <int MI, int NN>
__device__ __forceinline__ void qsa_store_wgmma_acc(__nv_bfloat16* y, const __nv_bfloat16* b,
                                                    int M, int N, int row0, int col0, int lane,
                                                    float (&acc)[MI][NN / 2],
                                                    const __nv_bfloat162* pre = nullptr) {
  qsa_wgmma_epilogue<MI, NN>(
      b, N, col0, lane, acc,
      [&](int r, int c, __nv_bfloat162 bias, float v0, float v1) {
        qsa_store_pair(y, bias, M, N, row0 + r, col0 + c, v0, v1);
      },
      pre);
}

// The TMA-store epilogue's half: the same pairs into shared memory, in the layout the store's
// tensor map reads: 64-column boxes of [TM rows x 128 bytes] with the 128-byte swizzle. The
// eight rows of one 8x8 fragment land in eight different 16-byte chunks, so each of its
// stores hits 32 banks. Only boxes [box_lo, box_hi) are staged (one round): box box_lo + r goes
// to offset (r % BPS) boxes into ring stage `base0` (r < BPS) or `base1`. row0: this lane's
// first accumulator row inside the tile (the warp's first row + lane/4); lcol0: the warp's
// first column inside the tile; gcol0: that column in y (bias). Rows and columns past M and N
// are staged too; the TMA store clips them.
template <int MI, int NN, int TM, int BPS>
__device__ __forceinline__ void qsa_stage_wgmma_acc(unsigned base0, unsigned base1, int box_lo,
                                                    int box_hi, const __nv_bfloat16* b, int N,
                                                    int row0, int lcol0, int gcol0, int lane,
                                                    float (&acc)[MI][NN / 2],
                                                    const __nv_bfloat162* pre = nullptr) {
  // One stmatrix.x4 per two column groups and 16 rows: lanes 8m..8m+7 address the rows of
  // fragment m (rows +8 for m odd, the next column group for m >= 2). lcol0 is a multiple of 16,
  // so both groups lie in one 64-column box, and the box test is the same for the whole warp.
  const int wrow0 = row0 - (lane >> 2);
  const int frag_row = ((lane >> 3) & 1) * 8 + (lane & 7);
  const int frag_chunk = lane >> 4;
  qsa_wgmma_epilogue_x4<MI, NN>(
      b, N, gcol0, lane, acc,
      [&](int r, int c, const unsigned (&v)[4]) {
        const int col = lcol0 + c;
        const int box = (col >> 6) - box_lo;
        if (box < 0 || box >= box_hi - box_lo) {
          return;
        }
        const unsigned base = box < BPS ? base0 + static_cast<unsigned>(box * TM * 128)
                                        : base1 + static_cast<unsigned>((box - BPS) * TM * 128);
        const unsigned addr =
            base + qsa_swz(wrow0 + r + frag_row, ((col & 63) >> 3) + frag_chunk);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                         addr),
                     "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                     : "memory");
      },
      pre);
}

// One thread block computes one [TM, TN] tile of y. TM, TN, TK: block tile; WARPS: warps per
// block; WALK_M: grouped rasterisation (SWEEP.md §4); STAGES: cp.async ring depth; WGMMA: 1 for
// warpgroup MMA, 0 for warp mma.sync; LAYOUT_M: warpgroups (or warps) stacked along M, the
// rest split N.
template <int TM, int TN, int TK, int WARPS, int WALK_M, int STAGES, int WGMMA, int LAYOUT_M>
__device__ __forceinline__ void qsa_gemm(const __nv_bfloat16* x, const __nv_bfloat16* w,
                                         const __nv_bfloat16* b, __nv_bfloat16* y, int M, int N,
                                         int K) {
  constexpr int THREADS = WARPS * 32;
  constexpr int STAGE_A = TM * TK * 2;
  constexpr int STAGE_BYTES = (TM + TN) * TK * 2;
  // One wgmma group stays in flight when the ring has room for it.
  constexpr int INFLIGHT = (WGMMA && STAGES >= 3) ? 1 : 0;
  constexpr int PD = STAGES - 1 - INFLIGHT;  // k-slices loaded ahead of the one computed
  static_assert(TK % 64 == 0, "TK must be a multiple of the 64-column swizzle atom");

  extern __shared__ unsigned char qsa_smem[];
  const unsigned smem0 = (qsa_smem_u32(qsa_smem) + 1023u) & ~1023u;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;

  // Tile rasterisation (SWEEP.md §4).
  const int tiles_m = (M + TM - 1) / TM;
  const int tiles_n = (N + TN - 1) / TN;
  const int pid = blockIdx.x;
  int tile_m, tile_n;
  if constexpr (WALK_M == 0) {
    tile_m = pid / tiles_n;
    tile_n = pid % tiles_n;
  } else {
    const int span = WALK_M * tiles_n;
    const int first = (pid / span) * WALK_M;
    const int g = min(tiles_m - first, WALK_M);
    const int r = pid % span;
    tile_m = first + r % g;
    tile_n = r / g;
  }
  const int m0 = tile_m * TM;
  const int n0 = tile_n * TN;
  const int KT = (K + TK - 1) / TK;

  auto load_stage = [&](int kt, int slot) {
    const unsigned base = smem0 + static_cast<unsigned>(slot * STAGE_BYTES);
    qsa_load_tile<TM, TK, THREADS>(base, x, M, K, m0, kt * TK, tid);
    qsa_load_tile<TN, TK, THREADS>(base + STAGE_A, w, N, K, n0, kt * TK, tid);
  };
  // The ring's k-loop: PD k-slices loaded ahead of the one computed (PD 0: load, wait and
  // compute one at a time); step(a_base, b_base) computes a k-slice from its stage. wgmma reads
  // the stages through the async proxy, so that path fences them before the barrier.
  auto k_loop = [&](auto&& step) {
#pragma unroll
    for (int s = 0; s < PD; ++s) {
      if (s < KT) {
        load_stage(s, s);
      }
      qsa_cp_async_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
      if constexpr (PD == 0) {
        __syncthreads();
        load_stage(kt, 0);
        qsa_cp_async_commit();
        qsa_cp_async_wait<0>();
      } else {
        qsa_cp_async_wait<(PD > 0 ? PD - 1 : 0)>();
      }
      if constexpr (WGMMA) {
        qsa_fence_proxy_async();
      }
      __syncthreads();
      if constexpr (PD > 0) {
        // The slot refilled here was last read at k-slice kt - 1 - INFLIGHT (the wgmma groups
        // left in flight), which every warp finished before the barrier.
        const int nk = kt + PD;
        if (nk < KT) {
          load_stage(nk, nk % STAGES);
        }
        qsa_cp_async_commit();
      }
      const int slot = (PD == 0) ? 0 : kt % STAGES;
      const unsigned a_base = smem0 + static_cast<unsigned>(slot * STAGE_BYTES);
      step(a_base, a_base + STAGE_A);
    }
  };

  if constexpr (WGMMA) {
    // Warpgroup g owns rows [wg_m·WG_TM, +WG_TM) and columns [wg_n·WG_TN, +WG_TN).
    constexpr int WGS = WARPS / 4;
    constexpr int WG_TM = TM / LAYOUT_M;
    constexpr int WG_TN = TN / (WGS / LAYOUT_M);
    constexpr int MI = WG_TM / 64;
    const int wg = warp >> 2;
    const int wg_m = wg % LAYOUT_M;
    const int wg_n = wg / LAYOUT_M;
    float acc[MI][WG_TN / 2];
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int j = 0; j < WG_TN / 2; ++j) {
        acc[i][j] = 0.0f;
      }
    }

    k_loop([&](unsigned a_base, unsigned b_base) {
      qsa_wgmma_kslice<TM, TN, TK, MI, WG_TN>(acc, a_base, b_base, wg_m * WG_TM, wg_n * WG_TN);
      qsa_wgmma_wait<INFLIGHT>();
    });
    qsa_wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int j = 0; j < WG_TN / 2; ++j) {
        qsa_reg_fence(acc[i][j]);
      }
    }

    qsa_store_wgmma_acc<MI, WG_TN>(y, b, M, N,
                                   m0 + wg_m * WG_TM + (warp & 3) * 16 + (lane >> 2),
                                   n0 + wg_n * WG_TN, lane, acc);
  } else {
    // Warp (wm, wn) owns a [WTM, WTN] sub-tile: MI x NI tiles of m16n8.
    constexpr int WN_ = WARPS / LAYOUT_M;
    constexpr int WTM = TM / LAYOUT_M;
    constexpr int WTN = TN / WN_;
    constexpr int MI = WTM / 16;
    constexpr int NI = WTN / 8;
    static_assert(NI % 2 == 0, "warp N extent must be a multiple of 16");
    const int wm = warp % LAYOUT_M;
    const int wn = warp / LAYOUT_M;
    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int j = 0; j < NI; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc[i][j][e] = 0.0f;
        }
      }
    }

    k_loop([&](unsigned a_base, unsigned b_base) {
#pragma unroll
      for (int ks = 0; ks < TK / 16; ++ks) {
        const int atom = ks >> 2;
        const int chunk0 = (ks & 3) * 2;
        unsigned af[MI][4];
        unsigned bf[NI][2];
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          const int r = wm * WTM + i * 16 + (lane & 15);
          const int c = chunk0 + (lane >> 4);
          qsa_ldmatrix_x4(af[i], a_base + static_cast<unsigned>(atom * TM * 128) + qsa_swz(r, c));
        }
#pragma unroll
        for (int j = 0; j < NI / 2; ++j) {
          const int r = wn * WTN + j * 16 + (lane & 7) + ((lane >> 4) << 3);
          const int c = chunk0 + ((lane >> 3) & 1);
          unsigned t[4];
          qsa_ldmatrix_x4(t, b_base + static_cast<unsigned>(atom * TN * 128) + qsa_swz(r, c));
          bf[2 * j][0] = t[0];
          bf[2 * j][1] = t[1];
          bf[2 * j + 1][0] = t[2];
          bf[2 * j + 1][1] = t[3];
        }
#pragma unroll
        for (int i = 0; i < MI; ++i) {
#pragma unroll
          for (int j = 0; j < NI; ++j) {
            qsa_mma_16816(acc[i][j], af[i], bf[j][0], bf[j][1]);
          }
        }
      }
    });

    // m16n8 accumulator layout: c0, c1 at row lane/4, columns 2(lane%4) (+1); c2, c3 at row +8.
    // Bias first (see qsa_load_bias), then the stores.
    __nv_bfloat162 bias[NI];
    qsa_load_bias(bias, b, N, n0 + wn * WTN, lane);
#pragma unroll
    for (int i = 0; i < MI; ++i) {
      const int row = m0 + wm * WTM + i * 16 + (lane >> 2);
#pragma unroll
      for (int j = 0; j < NI; ++j) {
        const int col = n0 + wn * WTN + j * 8 + 2 * (lane & 3);
        qsa_store_pair(y, bias[j], M, N, row, col, acc[i][j][0], acc[i][j][1]);
        qsa_store_pair(y, bias[j], M, N, row + 8, col, acc[i][j][2], acc[i][j][3]);
      }
    }
  }
}


// ---- TMA-fed, warp-specialised, persistent wgmma kernel (family "tma", sm_90a) ----
//
// WARPS consumer warps (whole warpgroups) run wgmma; one more warp (or, with CONSUMER_REGS, one
// more warpgroup) is the producer: lane 0 of its first warp issues TMA tile loads (cp.async.bulk.tensor) into a STAGES-deep ring guarded by mbarriers
// (full[s]: bytes landed; empty[s]: every consumer warp finished reading). The grid holds at
// most one block per SM and each block walks tiles blockIdx.x, +gridDim.x, ... in the
// rasterisation of SWEEP.md §4, so the producer already loads the next tile while the consumers
// run the epilogue. The TMA unit reads tensor maps from global memory: the host encodes one
// template per operand (`tmaps`, 128 bytes each: x, W, and y for the TMA store, at a placeholder
// address); the producer warp copies each into shared memory, points it at the real operand
// with tensormap.replace and publishes it to this block's slot of `scratch` (128 bytes a map).
// The launcher puts launch bounds on the kernel (gemm.py, launch_bounds_header), so NVRTC keeps
// every warp within its share of the register file.

__device__ __forceinline__ void qsa_mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Register budget of the executing warpgroup (sm_90a; every thread of the warpgroup executes
// it): the producer gives registers back, the consumers take them for larger accumulators.
template <int REGS>
__device__ __forceinline__ void qsa_setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

template <int REGS>
__device__ __forceinline__ void qsa_setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

__device__ __forceinline__ void qsa_fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void qsa_mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void qsa_mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// `count` arrivals at once (one thread standing in for `count` warps).
__device__ __forceinline__ void qsa_mbar_arrive_n(unsigned bar, unsigned count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(count)
               : "memory");
}

// Spins until the phase of parity `parity` of the barrier has completed (acquire at CTA scope,
// also for the barriers the other CTA of a cluster arrives on: those arrivals only say that a
// stage's reads are done, and the TMA writes that follow are ordered by the barrier itself).
__device__ __forceinline__ void qsa_mbar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// Box {64 columns, rows} at element coordinates (c0 = column, c1 = row) into shared `dst`;
// completion counts its bytes on barrier `bar`. Out-of-bounds elements arrive as zeros.
__device__ __forceinline__ void qsa_tma_load_2d(unsigned dst, const void* tmap, unsigned bar,
                                                int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(tmap), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// The same box delivered to offset `dst` of every CTA of the cluster in `cta_mask`; each
// destination CTA's barrier at offset `bar` counts the bytes.
__device__ __forceinline__ void qsa_tma_load_2d_multicast(unsigned dst, const void* tmap,
                                                          unsigned bar, int c0, int c1,
                                                          unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(dst),
      "l"(tmap), "r"(bar), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

// Arrival on the barrier at offset `bar` of CTA `cta` of this cluster, with the default
// (CTA-scope) release: a consumer only read the stage, through wgmma, and has waited for those
// reads. A cluster-scope release made every consumer warp wait on a memory barrier once per
// k-slice (Nsight Compute, H100: 40 % of the cluster kernels' stall cycles).
__device__ __forceinline__ void qsa_mbar_arrive_remote(unsigned bar, unsigned cta) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}

// `count` arrivals on the barrier at offset `bar` of CTA `cta` of this cluster.
__device__ __forceinline__ void qsa_mbar_arrive_remote_n(unsigned bar, unsigned cta,
                                                         unsigned count) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0], %1;\n" ::"r"(remote), "r"(count)
               : "memory");
}

// Every thread of every CTA of the cluster.
__device__ __forceinline__ void qsa_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Box {64 columns, rows} of shared `src` to y at element coordinates (c0 = column, c1 = row);
// the TMA unit skips elements outside the matrix. Joins this thread's current bulk group.
__device__ __forceinline__ void qsa_tma_store_2d(const void* tmap, unsigned src, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(tmap),
      "r"(src), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void qsa_bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// This thread's bulk groups have finished reading their shared memory (READ_ONLY) or have
// completed their writes too.
template <bool READ_ONLY>
__device__ __forceinline__ void qsa_bulk_wait_all() {
  if constexpr (READ_ONLY) {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
}

// Barrier 1 among the THREADS consumer threads only (the producer warps never reach it).
template <int THREADS>
__device__ __forceinline__ void qsa_consumer_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory");
}

// One full warp: template (global, 16 x u64) -> shared copy -> global address replaced ->
// published to `slot` (global, 128-byte aligned) and acquired for this thread's TMA loads.
__device__ __forceinline__ void qsa_tmap_publish(const unsigned long long* tmpl,
                                                 unsigned long long* shared_map,
                                                 unsigned long long* slot, const void* base,
                                                 int lane) {
  if (lane < 16) {
    shared_map[lane] = tmpl[lane];
  }
  __syncwarp();
  if (lane == 0) {
    asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;\n" ::"r"(
                     qsa_smem_u32(shared_map)),
                 "l"(base)
                 : "memory");
  }
  __syncwarp();
  asm volatile(
      "tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned"
      " [%0], [%1], 128;\n" ::"l"(slot),
      "r"(qsa_smem_u32(shared_map))
      : "memory");
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(slot) : "memory");
}

// CONSUMER_REGS = 0: the producer is one warp and every warp keeps the kernel's register count.
// CONSUMER_REGS > 0: the producer is a whole warpgroup that drops to PRODUCER_REGS registers
// per thread, and the consumer warpgroups raise theirs to CONSUMER_REGS (accumulators above what
// the launch bounds allow every thread).
// CLUSTER = 2 (family "tma_mc", launched as clusters of two CTAs): the pair computes the tiles
// of two neighbouring M rows that share their W tile; each CTA loads its own x tile and half the
// W tile, multicast into both CTAs, so W crosses L2 once per pair. A stage is refilled only once
// the consumers of both CTAs have released it (each consumer warp arrives on both CTAs' empty
// barriers), and neither CTA exits while the other may still arrive on its barriers.
// TMA_STORE = 1 (families "tma_st" and "tma_mc_st"): the consumers stage each finished tile (plus
// bias, as bf16) in shared memory and one thread hands it to the TMA unit as TN/64 box stores
// through a third tensor map (y's), then the warpgroups go straight on to the next tile's
// k-slices while the store drains. The staging space is the ring itself: the stages of the
// tile's last k-slices (two for a 192x192 tile), which the consumers keep until the stores have
// read them, so the ring is as deep as without the TMA store (cuBLASLt's 192x192 kernel runs
// four stages; a separate staging tile left room for three). With SPARE_BOXES > 0 (the planner
// sets it where the shared memory beside the ring allows) the tile keeps one stage and its
// remaining boxes go to a spare region after the ring. TMA_STORE = 0 stores from the
// accumulator registers to y directly (pairs of bf16 per thread).
template <int TM, int TN, int TK, int WARPS, int WALK_M, int STAGES, int LAYOUT_M,
          int PRODUCER_REGS, int CONSUMER_REGS, int CLUSTER, int TMA_STORE, int SPARE_BOXES>
__device__ __forceinline__ void qsa_gemm_tma(const __nv_bfloat16* x, const __nv_bfloat16* w,
                                             const __nv_bfloat16* b,
                                             const unsigned long long* tmaps, __nv_bfloat16* y,
                                             unsigned char* scratch, int M, int N, int K) {
  constexpr int ATOMS = TK / 64;  // 64-column boxes per operand per stage
  constexpr int STAGE_A = TM * TK * 2;
  constexpr int STAGE_BYTES = (TM + TN) * TK * 2;
  constexpr int WGS = WARPS / 4;
  constexpr int WG_TM = TM / LAYOUT_M;
  constexpr int WG_TN = TN / (WGS / LAYOUT_M);
  constexpr int MI = WG_TM / 64;
  static_assert(TK % 64 == 0 && WARPS % 4 == 0, "whole swizzle atoms and whole warpgroups");
  static_assert(TM <= 256 && TN <= 256, "a TMA box spans at most 256 rows");
  static_assert(CLUSTER == 1 || (CLUSTER == 2 && (TN / 2) % 8 == 0), "pairs split W by 8 rows");
  constexpr int B_ROWS = TN / CLUSTER;  // W rows this CTA loads per stage
  static_assert(TMA_STORE == 0 || TN % 64 == 0, "the TMA store writes 64-column boxes");
  constexpr int NMAPS = TMA_STORE ? 3 : 2;  // x, W (and y)
  // TMA_STORE: the finished tile is staged in the ring itself, in the stages of the tile's last
  // HOLD k-slices, which the consumers keep instead of handing back (BPS boxes a stage).
  constexpr int BOXES = TN / 64;
  constexpr int BPS = STAGE_BYTES / (TM * 128);
  constexpr int HOLD_NEED = BPS > 0 ? (BOXES + BPS - 1) / BPS : 1;
  // SPARE_BOXES > 0: the boxes one stage cannot hold go to a region of their own after the ring,
  // so the consumers keep a single stage and the producer prefetches the next tile into the
  // other STAGES - 1 during the epilogue.
  constexpr int HOLD_MAX = SPARE_BOXES > 0 ? 1 : HOLD_NEED < 2 ? HOLD_NEED : 2;
  static_assert(TMA_STORE == 0 || BPS >= 1, "a ring stage holds at least one box of the tile");
  static_assert(SPARE_BOXES == 0 || (TMA_STORE && SPARE_BOXES == BOXES - BPS && SPARE_BOXES <= BPS),
                "the spare region holds the boxes beyond one stage's");

  extern __shared__ unsigned char qsa_smem[];
  const unsigned raw = qsa_smem_u32(qsa_smem);
  const unsigned smem0 = (raw + 1023u) & ~1023u;
  // After the ring (stages and boxes start 1024-byte aligned, as the swizzle needs): the spare
  // boxes, NMAPS 128-byte tensor maps, then full[STAGES] and empty[STAGES].
  const unsigned spare0 = smem0 + static_cast<unsigned>(STAGES * STAGE_BYTES);
  const unsigned maps_u32 = spare0 + static_cast<unsigned>(SPARE_BOXES * TM * 128);
  unsigned long long* maps_s =
      reinterpret_cast<unsigned long long*>(qsa_smem + (maps_u32 - raw));
  const unsigned full0 = maps_u32 + 128u * NMAPS;
  const unsigned empty0 = full0 + 8u * STAGES;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  // The schedule walks units of CLUSTER vertically adjacent tiles (one tile when CLUSTER = 1);
  // a pair's second tile may lie below M: its x box arrives as zeros and its stores are masked.
  const int rank = CLUSTER == 2 ? static_cast<int>(blockIdx.x & 1u) : 0;
  const int unit0 = static_cast<int>(blockIdx.x) / CLUSTER;
  const int units = static_cast<int>(gridDim.x) / CLUSTER;
  const int tiles_m = ((M + TM - 1) / TM + CLUSTER - 1) / CLUSTER;
  const int tiles_n = (N + TN - 1) / TN;
  const int tiles = tiles_m * tiles_n;
  const int KT = (K + TK - 1) / TK;

  auto coords = [&](int t, int& m0, int& n0) {
    int tile_m, tile_n;
    if constexpr (WALK_M == 0) {
      tile_m = t / tiles_n;
      tile_n = t % tiles_n;
    } else {
      const int span = WALK_M * tiles_n;
      const int first = (t / span) * WALK_M;
      const int g = min(tiles_m - first, WALK_M);
      const int r = t % span;
      tile_m = first + r % g;
      tile_n = r / g;
    }
    m0 = (tile_m * CLUSTER + rank) * TM;
    n0 = tile_n * TN;
  };

  unsigned long long* slot = reinterpret_cast<unsigned long long*>(
      ((reinterpret_cast<unsigned long long>(scratch) + 127ull) & ~127ull) +
      128ull * NMAPS * blockIdx.x);
  if (warp == WARPS) {
    qsa_tmap_publish(tmaps, maps_s, slot, x, lane);
    qsa_tmap_publish(tmaps + 16, maps_s + 16, slot + 16, w, lane);
    if constexpr (TMA_STORE) {
      qsa_tmap_publish(tmaps + 32, maps_s + 32, slot + 32, y, lane);
    }
    if (lane == 0) {
      for (int s = 0; s < STAGES; ++s) {
        qsa_mbar_init(full0 + 8u * s, 1);
        qsa_mbar_init(empty0 + 8u * s, WARPS * CLUSTER);
      }
      qsa_fence_mbar_init();
    }
  }
  if constexpr (CLUSTER == 2) {
    qsa_cluster_sync();  // both CTAs' barriers exist before either CTA signals the other's
  } else {
    __syncthreads();
  }

  if (warp >= WARPS) {
    if constexpr (CONSUMER_REGS > 0) {
      qsa_setmaxnreg_dec<PRODUCER_REGS>();
    }
    if (warp == WARPS && lane == 0) {
      const void* map_x = slot;
      const void* map_w = slot + 16;
      int s = 0;
      unsigned phase = 0;
      for (int t = unit0; t < tiles; t += units) {
        int m0, n0;
        coords(t, m0, n0);
        for (int kt = 0; kt < KT; ++kt) {
          // A fresh barrier counts as having completed the phase before its first.
          qsa_mbar_wait(empty0 + 8u * s, phase ^ 1u);
          const unsigned full = full0 + 8u * s;
          // Own x tile plus the whole W tile (with CLUSTER = 2, half of it from the other CTA).
          qsa_mbar_expect_tx(full, STAGE_BYTES);
          const unsigned base = smem0 + static_cast<unsigned>(s * STAGE_BYTES);
#pragma unroll
          for (int a = 0; a < ATOMS; ++a) {
            qsa_tma_load_2d(base + static_cast<unsigned>(a * TM * 128), map_x, full,
                            kt * TK + a * 64, m0);
            const unsigned b_dst =
                base + static_cast<unsigned>(STAGE_A + a * TN * 128 + rank * B_ROWS * 128);
            if constexpr (CLUSTER == 2) {
              qsa_tma_load_2d_multicast(b_dst, map_w, full, kt * TK + a * 64,
                                        n0 + rank * B_ROWS, 0x3);
            } else {
              qsa_tma_load_2d(b_dst, map_w, full, kt * TK + a * 64, n0);
            }
          }
          if (++s == STAGES) {
            s = 0;
            phase ^= 1u;
          }
        }
      }
    }
    if constexpr (CLUSTER == 2) {
      __syncwarp();
      qsa_cluster_sync();
    }
    return;
  }

  if constexpr (CONSUMER_REGS > 0) {
    qsa_setmaxnreg_inc<CONSUMER_REGS>();
  }
  // Hands stage `st` back to the producers that refill it (this CTA's, and the other CTA's,
  // whose W half lands here too).
  auto release = [&](int st) {
    if (lane == 0) {
      qsa_mbar_arrive(empty0 + 8u * st);
      if constexpr (CLUSTER == 2) {
        qsa_mbar_arrive_remote(empty0 + 8u * st, static_cast<unsigned>(rank ^ 1));
      }
    }
  };
  // Consumers: warpgroup g owns rows [wg_m·WG_TM, +WG_TM) and columns [wg_n·WG_TN, +WG_TN).
  const int wg = warp >> 2;
  const int wg_m = wg % LAYOUT_M;
  const int wg_n = wg / LAYOUT_M;
  const int wq = warp & 3;
  const void* map_y = slot + 32;
  if constexpr (TMA_STORE) {
    if (tid == 0) {  // the one thread that issues the stores acquires y's published map
      asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map_y)
                   : "memory");
    }
  }
  int s = 0;
  unsigned phase = 0;
  float acc[MI][WG_TN / 2];
  // The tile's bias pairs, loaded before its k-loop (up to 16 registers; wider warpgroup tiles
  // load theirs in the epilogue).
  constexpr int JB = WG_TN / 8;
  constexpr bool PRELOAD = JB <= 16;
  __nv_bfloat162 bias_pre[PRELOAD ? JB : 1];
  // TMA_STORE: the stages of a tile's last `hold` k-slices stay with the consumers and receive
  // the staged tile; held0 / held1 are those of the previous tile, still being read by its
  // stores. The store-issuing thread hands them back (for every consumer warp, and in a
  // cluster to both CTAs' producers) once its stores have read them: after the next tile's
  // first k-slice is issued, where that wait costs nothing, unless the ring has no other stage
  // to load that k-slice into (STAGES == hold), then at once.
  const int hold = TMA_STORE ? (KT < HOLD_MAX ? KT : HOLD_MAX) : 0;
  const bool defer = STAGES > hold;
  int held0 = -1;
  int held1 = -1;
  auto release_held = [&]() {
    if (tid == 0) {
      qsa_bulk_wait_all<true>();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int st = h == 0 ? held0 : held1;
        if (st >= 0) {
          qsa_mbar_arrive_n(empty0 + 8u * st, WARPS);
          if constexpr (CLUSTER == 2) {
            qsa_mbar_arrive_remote_n(empty0 + 8u * st, static_cast<unsigned>(rank ^ 1), WARPS);
          }
        }
      }
    }
    __syncwarp();
    held0 = -1;
    held1 = -1;
  };
  for (int t = unit0; t < tiles; t += units) {
    int m0, n0;
    coords(t, m0, n0);
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int j = 0; j < WG_TN / 2; ++j) {
        acc[i][j] = 0.0f;
      }
    }
    if constexpr (PRELOAD) {
      qsa_load_bias(bias_pre, b, N, n0 + wg_n * WG_TN, lane);
    }
    int prev = -1;
    for (int kt = 0; kt < KT; ++kt) {
      qsa_mbar_wait(full0 + 8u * s, phase);
      const unsigned a_base = smem0 + static_cast<unsigned>(s * STAGE_BYTES);
      const unsigned b_base = a_base + STAGE_A;
      qsa_wgmma_kslice<TM, TN, TK, MI, WG_TN>(acc, a_base, b_base, wg_m * WG_TM, wg_n * WG_TN);
      if constexpr (TMA_STORE) {
        if (kt == 0 && held0 >= 0) {
          release_held();
        }
      }
      // The group of the previous k-slice has finished reading its stage: hand it back, unless
      // it is one the epilogue keeps.
      qsa_wgmma_wait<1>();
      if (prev >= 0 && kt - 1 < KT - hold) {
        release(prev);
      }
      prev = s;
      if (++s == STAGES) {
        s = 0;
        phase ^= 1u;
      }
    }
    qsa_wgmma_wait<0>();
    if (prev >= 0 && hold == 0) {
      release(prev);
    }
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int j = 0; j < WG_TN / 2; ++j) {
        qsa_reg_fence(acc[i][j]);
      }
    }
    if constexpr (TMA_STORE) {
      // Boxes go in rounds of hold·BPS (+ SPARE_BOXES; one round unless K is a single k-slice
      // without a spare region): box lo + r into stage h0 (r < BPS) or h1 (the spare region).
      const int h0 = hold == 2 ? (prev + STAGES - 1) % STAGES : prev;
      const int h1 = prev;
      const unsigned base0 = smem0 + static_cast<unsigned>(h0 * STAGE_BYTES);
      const unsigned base1 =
          SPARE_BOXES > 0 ? spare0 : smem0 + static_cast<unsigned>(h1 * STAGE_BYTES);
      const int cap = hold * BPS + SPARE_BOXES;
      for (int lo = 0; lo < BOXES; lo += cap) {
        const int hi = lo + cap < BOXES ? lo + cap : BOXES;
        if (lo > 0 && tid == 0) {
          qsa_bulk_wait_all<true>();  // the last round's stores have read the stages
        }
        // Every warpgroup's wgmma reads of the held stages are done (and the stores' reads).
        qsa_consumer_sync<WARPS * 32>();
        qsa_fence_proxy_async();  // generic writes where the async proxy wrote and read
        qsa_stage_wgmma_acc<MI, WG_TN, TM, BPS>(base0, base1, lo, hi, b, N,
                                                wg_m * WG_TM + wq * 16 + (lane >> 2),
                                                wg_n * WG_TN, n0 + wg_n * WG_TN, lane, acc,
                                                PRELOAD ? bias_pre : nullptr);
        qsa_fence_proxy_async();  // the staged boxes, written by the generic proxy, for the TMA unit
        qsa_consumer_sync<WARPS * 32>();
        if (tid == 0) {
          for (int box = lo; box < hi; ++box) {
            const int r = box - lo;
            const unsigned src = r < BPS ? base0 + static_cast<unsigned>(r * TM * 128)
                                         : base1 + static_cast<unsigned>((r - BPS) * TM * 128);
            if (n0 + box * 64 < N && m0 < M) {  // a pair's second tile may lie below M
              qsa_tma_store_2d(map_y, src, n0 + box * 64, m0);
            }
          }
          qsa_bulk_commit();
        }
      }
      held0 = h0;
      held1 = hold == 2 ? h1 : -1;
      if (!defer) {
        release_held();
      }
    } else {
      qsa_store_wgmma_acc<MI, WG_TN>(y, b, M, N, m0 + wg_m * WG_TM + wq * 16 + (lane >> 2),
                                     n0 + wg_n * WG_TN, lane, acc, PRELOAD ? bias_pre : nullptr);
    }
  }
  if constexpr (TMA_STORE) {
    if (tid == 0) {
      qsa_bulk_wait_all<false>();  // the block's shared memory outlives its last store
    }
  }
  if constexpr (CLUSTER == 2) {
    qsa_cluster_sync();  // the other CTA's last arrivals on this CTA's barriers have landed
  }
}
